# The API reference: `cmake --build build --target dalle_api_docs` runs Doxygen over
# include/dalle/ into build/docs/api/ (index.html). Defined only where Doxygen is found
# (Debian: apt-get install doxygen); nothing else depends on it and it is not built by
# default.
find_package(Doxygen QUIET)
find_package(Python3 COMPONENTS Interpreter QUIET)
if(DOXYGEN_FOUND AND Python3_Interpreter_FOUND)
  set(DALLE_API_DOCS_DIR ${CMAKE_CURRENT_BINARY_DIR}/docs/api)
  configure_file(${PROJECT_SOURCE_DIR}/docs/api/Doxyfile.in ${CMAKE_CURRENT_BINARY_DIR}/docs/Doxyfile @ONLY)
  file(GLOB_RECURSE DALLE_PUBLIC_HEADERS CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/dalle/*.h)
  add_custom_command(
    OUTPUT ${DALLE_API_DOCS_DIR}/index.html
    COMMAND ${CMAKE_COMMAND} -E make_directory ${DALLE_API_DOCS_DIR}
    COMMAND Doxygen::doxygen ${CMAKE_CURRENT_BINARY_DIR}/docs/Doxyfile
    DEPENDS ${CMAKE_CURRENT_BINARY_DIR}/docs/Doxyfile ${PROJECT_SOURCE_DIR}/docs/api/doxygen_filter.py
            ${PROJECT_SOURCE_DIR}/docs/api/mainpage.md ${DALLE_PUBLIC_HEADERS}
    COMMENT "Doxygen: the API reference of include/dalle/ into ${DALLE_API_DOCS_DIR}"
    VERBATIM)
  add_custom_target(dalle_api_docs DEPENDS ${DALLE_API_DOCS_DIR}/index.html)
else()
  message(STATUS "dalle: no Doxygen, no dalle_api_docs target (apt-get install doxygen)")
endif()
