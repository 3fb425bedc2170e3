// A standalone driver for an LLVMFuzzerTestOneInput that gives its seeds (mutation_driver.h), for
// compilers without libFuzzer: runs the seeds, then N inputs made by stacking random mutations on
// them (bit flips, byte edits, insertions, deletions, duplications, splices, and tokens of JSON,
// HTTP and Jinja). The first byte of an input (the target's selector) is rarely changed.
//
//   fuzz_X [iterations] [random_seed]   run; exits non-zero only by crashing
//   fuzz_X --write-corpus DIR           write the seeds as files, for a libFuzzer run
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/fuzz/mutation_driver.h"

namespace duet::fuzz {
namespace {

const char* const kTokens[] = {
    "\"", "{", "}", "[", "]", ",", ":", "null", "true", "false", "-1", "0", "1e999", "-0.0",
    "99999999999999999999", "2147483648", "\\u0000", "\\ud800", "\\\"", "\xff", "\xc3", "\xf0\x9f",
    "\r\n", "\r\n\r\n", " ", "Content-Length: ", "Transfer-Encoding: chunked\r\n", "0\r\n\r\n",
    "HTTP/1.0", "HTTP/1.1", "{{", "}}", "{%", "%}", "{#", "#}", "|tojson", "messages", "loop.index",
    "raise_exception('x')", "\"role\"", "\"content\"", "\"prompt\"", "\"tokens\"", "\"n\"",
    "\"max_tokens\"", "\"stop\"", "\"logprobs\"", "<s>", "</s>", "<|im_start|>",
};

class Mutator {
 public:
  Mutator(uint64_t seed, const std::vector<std::string>& seeds) : rng_(seed), seeds_(seeds) {}

  std::string Next() {
    std::string input = seeds_[Below(seeds_.size())];
    const size_t mutations = 1 + Below(8);
    for (size_t m = 0; m < mutations; ++m) Mutate(input);
    return input;
  }

 private:
  size_t Below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  // A position after the selector byte (most of the time).
  size_t Position(const std::string& s, bool inclusive_end) {
    const size_t first = (s.size() > 1 && Below(64) != 0) ? 1 : 0;
    const size_t span = s.size() - first + (inclusive_end ? 1 : 0);
    return first + Below(span);
  }

  void Mutate(std::string& s) {
    switch (Below(7)) {
      case 0:  // flip a bit
        if (!s.empty()) s[Position(s, false)] ^= static_cast<char>(1u << Below(8));
        break;
      case 1:  // set a byte
        if (!s.empty()) s[Position(s, false)] = static_cast<char>(Below(256));
        break;
      case 2: {  // insert random bytes
        std::string bytes(1 + Below(8), '\0');
        for (char& c : bytes) c = static_cast<char>(Below(256));
        s.insert(Position(s, true), bytes);
        break;
      }
      case 3: {  // delete a range
        if (s.size() < 2) break;
        const size_t at = Position(s, false);
        s.erase(at, 1 + Below(std::min<size_t>(64, s.size() - at)));
        break;
      }
      case 4: {  // duplicate a range
        if (s.empty()) break;
        const size_t at = Position(s, false);
        const std::string part = s.substr(at, 1 + Below(std::min<size_t>(256, s.size() - at)));
        s.insert(Position(s, true), part);
        break;
      }
      case 5: {  // splice in part of another seed (not its selector)
        const std::string& other = seeds_[Below(seeds_.size())];
        if (other.size() < 2) break;
        const size_t from = 1 + Below(other.size() - 1);
        s.insert(Position(s, true), other.substr(from, 1 + Below(std::min<size_t>(512, other.size() - from))));
        break;
      }
      default:  // a token of the formats under test
        s.insert(Position(s, true), kTokens[Below(sizeof(kTokens) / sizeof(kTokens[0]))]);
        break;
    }
  }

  std::mt19937_64 rng_;
  const std::vector<std::string>& seeds_;
};

int WriteCorpus(const std::string& dir, const std::vector<std::string>& seeds) {
  std::filesystem::create_directories(dir);
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream out(dir + "/seed-" + std::to_string(i), std::ios::binary);
    out << seeds[i];
  }
  std::printf("%zu seeds written to %s\n", seeds.size(), dir.c_str());
  return 0;
}

int Run(int argc, char** argv) {
  const std::vector<std::string> seeds = Seeds();
  if (argc == 3 && std::string(argv[1]) == "--write-corpus") return WriteCorpus(argv[2], seeds);
  const uint64_t iterations = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 10000;
  const uint64_t random_seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  const auto start = std::chrono::steady_clock::now();
  auto run = [](const std::string& input) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  };
  for (const std::string& seed : seeds) run(seed);
  Mutator mutator(random_seed, seeds);
  for (uint64_t i = 0; i < iterations; ++i) run(mutator.Next());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%zu seeds and %llu mutated inputs in %.1f s, no crash\n", seeds.size(),
              static_cast<unsigned long long>(iterations), seconds);
  return 0;
}

}  // namespace
}  // namespace duet::fuzz

int main(int argc, char** argv) { return duet::fuzz::Run(argc, argv); }
