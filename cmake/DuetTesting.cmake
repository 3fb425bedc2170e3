# duet_add_test(NAME <name> SOURCES <files...> LIBS <targets...> [LABELS <labels...>])
# Builds one GoogleTest binary and registers each of its tests with CTest.
# The *_test.cpp files compile without optimisation: a test spends its time in the libraries it
# tests (built at the build type's level), and -O0 compiles the gtest/gRPC-heavy test files ~30%
# faster, the cold CI build's largest part.
include(GoogleTest)
function(duet_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  foreach(source IN LISTS ARG_SOURCES)
    if(source MATCHES "_test\\.cpp$")
      set_source_files_properties(${source} PROPERTIES COMPILE_OPTIONS -O0)
    endif()
  endforeach()
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_definitions(${ARG_NAME} PRIVATE
    DUET_MODELS_DIR="${DUET_MODELS_DIR}" DUET_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
    DUET_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  set(labels unit)
  if(ARG_LABELS)
    set(labels ${ARG_LABELS})
  endif()
  gtest_discover_tests(${ARG_NAME} PROPERTIES LABELS "${labels}" DISCOVERY_TIMEOUT 60)
endfunction()
