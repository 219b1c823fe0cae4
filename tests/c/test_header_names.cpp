// test_header_names.c compiled as C++: gpupool's headers are for C++ programs too.
#include "test_header_names.c"
