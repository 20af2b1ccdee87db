# Finds the installed torch by asking its Python package (never find_package(Torch), which
# needs a CUDA toolkit for CUDA builds of torch). Sets:
#   TORCH_INCLUDE_DIRS, TORCH_LIBRARY_DIR, TORCH_CXX11_ABI, Python3 (Development.Module)
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import torch, torch.utils.cpp_extension as e; print('|'.join(e.include_paths())); print(e.library_paths()[0]); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_info
  RESULT_VARIABLE _torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "could not import torch with ${Python3_EXECUTABLE}; install torch first (pip install torch==2.13.0)")
endif()
string(REGEX MATCHALL "[^\n]+" _torch_parts "${_torch_info}")
list(GET _torch_parts 0 _torch_includes)
list(GET _torch_parts 1 TORCH_LIBRARY_DIR)
list(GET _torch_parts 2 TORCH_CXX11_ABI)
list(GET _torch_parts 3 TORCH_VERSION)
string(REPLACE "|" ";" TORCH_INCLUDE_DIRS "${_torch_includes}")
message(STATUS "torch ${TORCH_VERSION}: ${TORCH_LIBRARY_DIR} (cxx11 abi ${TORCH_CXX11_ABI})")

foreach(lib c10 torch torch_cpu torch_python)
  find_library(TORCH_${lib}_LIB ${lib} PATHS "${TORCH_LIBRARY_DIR}" NO_DEFAULT_PATH REQUIRED)
endforeach()

# Link flags and definitions every target built against torch needs.
add_library(torch_deps INTERFACE)
target_include_directories(torch_deps SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
target_compile_definitions(torch_deps INTERFACE _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI})
target_link_libraries(torch_deps INTERFACE ${TORCH_c10_LIB} ${TORCH_torch_LIB} ${TORCH_torch_cpu_LIB})
