// What a fuzz target gives the standalone mutation driver (mutation_driver.cpp): its seeds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace duet::fuzz {

// Inputs to start from, each as LLVMFuzzerTestOneInput takes it.
std::vector<std::string> Seeds();

}  // namespace duet::fuzz
