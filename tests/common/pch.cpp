// The translation unit of twobp_test_pch (tests/CMakeLists.txt): the target exists to build the tests'
// precompiled header with their flags; this file adds nothing to it.
