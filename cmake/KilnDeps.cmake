# Every third-party dependency of kiln, found (never vendored).
find_package(Threads REQUIRED)
if(KILN_KERNELS_ONLY)
  set(KILN_DOCTEST_INCLUDE "" CACHE PATH "Directory holding doctest/doctest.h")
  find_package(doctest QUIET)
  if(NOT TARGET doctest::doctest)
    add_library(doctest::doctest INTERFACE IMPORTED)
    set_target_properties(doctest::doctest PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${KILN_DOCTEST_INCLUDE}")
  endif()
else()
find_package(CAF 0.17 REQUIRED)
find_package(cppzmq REQUIRED)
find_package(msgpack REQUIRED)  # Debian: msgpackc-cxx target
find_package(spdlog REQUIRED)
find_package(doctest REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(ZLIB REQUIRED)
# PCRE2 (Debian: libpcre2-dev) runs the pre-tokenizer regex of tokenizer.json files
# (actors/rollout/bpe_tokenizer.cpp). Debian 12 ships no CMake config for it: header + library.
find_path(PCRE2_INCLUDE_DIR pcre2.h)
find_library(PCRE2_8_LIBRARY pcre2-8)
if(NOT EXISTS "${PCRE2_INCLUDE_DIR}/pcre2.h" OR NOT EXISTS "${PCRE2_8_LIBRARY}")
  message(FATAL_ERROR "PCRE2 not found (pcre2.h: ${PCRE2_INCLUDE_DIR}, libpcre2-8: ${PCRE2_8_LIBRARY}): "
                      "install the Debian package libpcre2-dev (scripts/setup.sh does), or point "
                      "CMAKE_PREFIX_PATH at a prefix holding include/pcre2.h and lib/libpcre2-8.so")
endif()
# cpp-httplib (Debian: libcpp-httplib-dev, 0.11) serves `kiln serve` and carries the HTTP rollout
# backend's requests. Debian ships it compiled (libcpp-httplib.so) with OpenSSL, zlib and brotli
# support: the header must see the same feature macros (its cpp-httplib.pc's Cflags) to match
# the library, and finds those libraries' headers beside its own. Header + library, as for PCRE2,
# so that scripts/offline_build.sh's prefix works without pkg-config.
find_path(HTTPLIB_INCLUDE_DIR httplib.h)
find_library(HTTPLIB_LIBRARY cpp-httplib)
if(NOT EXISTS "${HTTPLIB_INCLUDE_DIR}/httplib.h" OR NOT EXISTS "${HTTPLIB_LIBRARY}")
  message(FATAL_ERROR "cpp-httplib not found (httplib.h: ${HTTPLIB_INCLUDE_DIR}, libcpp-httplib: ${HTTPLIB_LIBRARY}): "
                      "install the Debian package libcpp-httplib-dev (scripts/setup.sh does)")
endif()
add_library(kiln_httplib INTERFACE IMPORTED)
set_target_properties(kiln_httplib PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${HTTPLIB_INCLUDE_DIR}"
                      INTERFACE_LINK_LIBRARIES "${HTTPLIB_LIBRARY};Threads::Threads"
                      INTERFACE_COMPILE_DEFINITIONS "CPPHTTPLIB_OPENSSL_SUPPORT;CPPHTTPLIB_ZLIB_SUPPORT;CPPHTTPLIB_BROTLI_SUPPORT")
add_library(kiln_pcre2 INTERFACE IMPORTED)
set_target_properties(kiln_pcre2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${PCRE2_INCLUDE_DIR}"
                      INTERFACE_LINK_LIBRARIES "${PCRE2_8_LIBRARY}")
endif()

include(CheckLanguage)
check_language(CUDA)
set(KILN_CUDA OFF)
if(CMAKE_CUDA_COMPILER)
  set(KILN_CUDA ON)
  # CMake 3.25 knows no C++20 flag for nvcc 13; CUDA sources use C++17.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200)
  endif()
  enable_language(CUDA)
endif()

if(KILN_WITH_TORCH)
  # The torch wheel's CMake package: -DCMAKE_PREFIX_PATH=$(python -c 'import torch.utils;
  # print(torch.utils.cmake_prefix_path)'); scripts/build.sh passes it.
  # Name the target GPUs, or Caffe2's CMake tries to run a CUDA program to detect them.
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  find_package(Torch REQUIRED)
  # TorchConfig appends its flags to CMAKE_CXX_FLAGS globally; keep them on torch targets.
  string(REPLACE "${TORCH_CXX_FLAGS}" "" CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS}")
  # One precompiled torch header shared (REUSE_FROM) by every torch-using target.
  add_library(kiln_torch_pch OBJECT "${CMAKE_CURRENT_LIST_DIR}/torch_pch.cpp")
  target_link_libraries(kiln_torch_pch PUBLIC torch)
  target_compile_options(kiln_torch_pch PRIVATE ${TORCH_CXX_FLAGS})
  target_precompile_headers(kiln_torch_pch PUBLIC <torch/torch.h>)
endif()

# kiln_use_torch(target): link LibTorch and reuse the shared precompiled header.
function(kiln_use_torch target)
  # The shared PCH is built -fPIC; an executable's sources compile -fPIE, and GCC then ignores
  # the PCH (-Winvalid-pch) and parses the torch headers again in every one of them.
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "EXECUTABLE")
    message(FATAL_ERROR "kiln_use_torch(${target}): an executable's -fPIE sources cannot use the torch PCH; "
                        "compile them in an OBJECT library that calls kiln_use_torch and link its objects")
  endif()
  target_link_libraries(${target} PUBLIC torch)
  target_compile_options(${target} PRIVATE ${TORCH_CXX_FLAGS})
  target_precompile_headers(${target} REUSE_FROM kiln_torch_pch)
endfunction()
