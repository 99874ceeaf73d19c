# kiln_discover_tests(TARGET PREFIX TIMEOUT): one ctest entry per doctest test case of TARGET.
# An entry whose output holds KILN_TEST_SKIPPED (tests/test_util.hpp: skip_unless, e.g. a CUDA
# case on a machine without a GPU) is reported as skipped, not passed. tests/main.cpp fails an
# entry that ran no test case.
include(doctest)
function(kiln_discover_tests target prefix timeout)
  doctest_discover_tests(${target} TEST_PREFIX "${prefix}"
                         PROPERTIES TIMEOUT ${timeout} SKIP_REGULAR_EXPRESSION "KILN_TEST_SKIPPED")
endfunction()
