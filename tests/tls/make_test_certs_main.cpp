// make_test_certs DIR: writes a fresh test PKI into DIR (tests/tls/test_certs.h lists the files),
// for the shell-driven tests (curl, the openai SDK).
#include <cstdio>

#include "tests/tls/test_certs.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_test_certs DIR\n");
    return 2;
  }
  duet::testing::MakeTestPki().WriteTo(argv[1]);
  return 0;
}
