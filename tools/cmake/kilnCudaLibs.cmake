# cuDNN and NCCL as imported targets (kiln::cudnn, kiln::nccl). CUDA's own libraries come from
# find_package(CUDAToolkit); cuDNN and NCCL have no CMake package of their own, so kiln's build
# and kiln's installed package (kilnConfig.cmake) both find them with this file, each on the
# machine where it runs: nothing found at kiln's build time is written into the package.
#
# kiln_find_cuda_libs() needs CUDAToolkit found first. Sets KILN_CUDNN_FOUND / KILN_NCCL_FOUND
# and creates the targets it found. cuDNN sits in the toolkit's folders on some machines and in
# the system's (Debian/Ubuntu packages) on others; CUDNN_ROOT / NCCL_ROOT (CMake variables or
# environment variables) point elsewhere.
include_guard(GLOBAL)

function(_kiln_find_one name header lib)
  string(TOUPPER ${name} up)
  find_path(KILN_${up}_INCLUDE ${header}
    HINTS ${${up}_ROOT} $ENV{${up}_ROOT} ${CUDAToolkit_INCLUDE_DIRS}
    PATH_SUFFIXES include
    PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/include)
  find_library(KILN_${up}_LIB ${lib}
    HINTS ${${up}_ROOT} $ENV{${up}_ROOT} ${CUDAToolkit_LIBRARY_DIR}
    PATH_SUFFIXES lib lib64
    PATHS /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64)
  if(KILN_${up}_INCLUDE AND KILN_${up}_LIB)
    set(KILN_${up}_FOUND TRUE PARENT_SCOPE)
    if(NOT TARGET kiln::${name})
      # GLOBAL in kiln's own build, so a parent project that add_subdirectory()s kiln sees it.
      if(KILN_IMPORTED_GLOBAL)
        add_library(kiln::${name} UNKNOWN IMPORTED GLOBAL)
      else()
        add_library(kiln::${name} UNKNOWN IMPORTED)
      endif()
      set_target_properties(kiln::${name} PROPERTIES
        IMPORTED_LOCATION "${KILN_${up}_LIB}"
        INTERFACE_INCLUDE_DIRECTORIES "${KILN_${up}_INCLUDE}")
    endif()
  else()
    set(KILN_${up}_FOUND FALSE PARENT_SCOPE)
  endif()
endfunction()

macro(kiln_find_cuda_libs)
  _kiln_find_one(cudnn cudnn.h cudnn)
  _kiln_find_one(nccl nccl.h nccl)
endmacro()
