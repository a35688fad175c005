# Every external dependency, found once. third_party/README.md says where each comes from.
# Naming the GPU architectures spares torch's CMake config a try_run that probes for GPUs
# (and fails with CMake 3.25 and a C++20 project). 9.0: H100/H200.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "9.0")
endif()
find_package(Torch 2.11 REQUIRED)
# third_party/gloo holds the gloo headers of this wheel's gloo: another torch may carry
# another gloo, whose objects' layout the headers would misdescribe.
if(NOT Torch_VERSION VERSION_EQUAL 2.11.0)
  message(FATAL_ERROR "third_party/gloo matches the gloo of torch 2.11.0; found torch ${Torch_VERSION}")
endif()
find_package(OpenCV 4 REQUIRED COMPONENTS core imgproc imgcodecs)
find_package(yaml-cpp REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(ZLIB REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(SentencePiece REQUIRED IMPORTED_TARGET sentencepiece)
find_package(Threads REQUIRED)
if(DALLE_BUILD_TOOLS)
  find_package(CLI11 REQUIRED)
  # dalle-serve's HTTP server: GNU libmicrohttpd's event loop (Debian's libmicrohttpd-dev).
  pkg_check_modules(Microhttpd REQUIRED IMPORTED_TARGET libmicrohttpd>=0.9.75)
endif()

# CUDA sources compile wherever nvcc exists; they run only where a GPU exists.
set(DALLE_HAS_CUDA OFF)
if(NOT DALLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # H100/H200, the GPUs this project is tuned for
    endif()
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no C++20 flags for nvcc 13
    enable_language(CUDA)
    set(DALLE_HAS_CUDA ON)
  elseif(DALLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DALLE_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

message(STATUS "dalle: CUDA sources ${DALLE_HAS_CUDA}")
