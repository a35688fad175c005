# Our own targets compile with -Wall -Wextra; DALLE_WARNINGS_AS_ERRORS makes every warning
# from our files an error (the project's scripts turn it on, so CI keeps the build silent;
# it stays off for a build by hand, where a newer compiler may warn of new things).
option(DALLE_WARNINGS_AS_ERRORS "Treat warnings from dalle's own files as errors" OFF)

function(dalle_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  if(DALLE_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()
