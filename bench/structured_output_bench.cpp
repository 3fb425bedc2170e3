// Structured outputs: the cost of grammar-constrained decoding.
//
// 1. Token masks (no model): per grammar, the time to build it, to classify every grammar
//    position against the vocabulary (the one-time token-mask cache), and per decoded token the
//    mask (FillNextTokenMask: median, p99, mean, max — the max is a state's first visit, whose
//    uncertain tokens are checked; later visits reuse its mask) and the advance (AcceptToken),
//    along random paths that draw a token uniformly from each mask. The vocabulary is the model's, or --tokenizer's
//    tokenizer.json (e.g. Llama 3's 128k vocabulary).
// 2. Decode speed on the engine (--backend cpu or cuda) at each --batch: unconstrained vs
//    constrained by a grammar of JSON objects, one per line, that never ends (so both run exactly
//    --gen-len tokens), at --temperature (0.8), median of --repeat rounds after an untimed round
//    of each (CUDA graphs captured, the grammar's cache warm). On cuda, constrained rows sample on
//    the device, their masks filled while the step runs.
// 3. With --speculation MODES (lookahead, draft, self): the constrained decode again with each
//    mode (adaptive budgets, as served), its tok/s against constrained without speculation, and
//    the draft tokens accepted per verified draft. Mode draft uses --draft-model.
//
//   build/bin/structured_output_bench [--model DIR] [--backend cpu|cuda] [--tokenizer tokenizer.json]
//                                     [--batch 1,8,32] [--gen-len 64] [--repeat 3] [--paths 20]
//                                     [--temperature 0.8] [--speculation lookahead,draft,self]
//                                     [--draft-model DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>

#include "CLI/CLI.hpp"
#include "backends/executor_factory.h"
#include "bench/sample_stats.h"
#include "engine/grammar/structured_output.h"
#include "engine/llm_engine.h"
#include "frontend/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using duet::grammar::StructuredOutput;

double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

constexpr char kJsonLinesGrammar[] = R"(root ::= (object "\n")+
object ::= "{" ws (pair (ws "," ws pair)*)? ws "}"
pair ::= string ws ":" ws value
value ::= string | number | object | array | "true" | "false" | "null"
array ::= "[" ws (value (ws "," ws value)*)? ws "]"
string ::= "\"" ([^"\\\x00-\x1F] | "\\" ["\\/bfnrt])* "\""
number ::= "-"? [0-9]{1,16} ("." [0-9]{1,16})?
ws ::= " "?)";

std::vector<std::pair<std::string, StructuredOutput>> MaskGrammars() {
  return {
      {"json_object", {StructuredOutput::Kind::kJsonObject, "", {}}},
      {"json_schema", {StructuredOutput::Kind::kJsonSchema,
                       R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                           "address": {"type": "object", "properties": {"street": {"type": "string"},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street"]}},
                           "required": ["name", "age", "address"]})",
                       {}}},
      {"regex", {StructuredOutput::Kind::kRegex, R"([a-z0-9._%+-]{1,20}@[a-z0-9.-]{1,20}\.[a-z]{2,4})", {}}},
      {"gbnf_json_lines", {StructuredOutput::Kind::kGrammar, kJsonLinesGrammar, {}}},
  };
}

std::shared_ptr<const duet::grammar::TokenVocabulary> VocabOf(const duet::Tokenizer& t, std::vector<int32_t> eos) {
  std::vector<std::optional<std::string>> strings(static_cast<size_t>(t.vocab_size()));
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (!t.IsSpecial(id)) strings[size_t(id)] = t.IdToToken(id);
  }
  return duet::grammar::TokenVocabulary::FromTokenStrings(strings, std::move(eos));
}

void BenchMasks(const duet::Tokenizer& tokenizer, const std::string& label, int paths, int path_len) {
  std::vector<int32_t> eos;
  if (auto id = tokenizer.eos_token_id()) eos.push_back(*id);
  const auto vocab = VocabOf(tokenizer, eos);
  std::printf("\n## Token masks: %s vocabulary (%d tokens), %d random paths of up to %d tokens\n\n", label.c_str(),
              vocab->size(), paths, path_len);
  std::printf("| grammar | build ms | cache fill ms (all positions) | mask µs/token median | p99 | mean | max | accept µs/token |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(1);
  for (const auto& [name, constraint] : MaskGrammars()) {
    duet::grammar::GrammarCompiler compiler(vocab);
    auto start = Clock::now();
    auto compiled = compiler.Compile(constraint);
    const double build_ms = 1000 * Since(start);
    if (!compiled.ok()) {
      std::printf("| %s | error: %s |\n", name.c_str(), std::string(compiled.status().message()).c_str());
      continue;
    }
    start = Clock::now();
    (*compiled)->PrecomputeAllPositions();
    const double cache_ms = 1000 * Since(start);
    std::vector<double> mask_us, accept_us;
    std::vector<uint32_t> mask(size_t(vocab->mask_words()));
    for (int p = 0; p < paths; ++p) {
      duet::grammar::GrammarMatcher m(*compiled);
      for (int step = 0; step < path_len && !m.IsTerminated(); ++step) {
        start = Clock::now();
        m.FillNextTokenMask(absl::MakeSpan(mask));
        mask_us.push_back(1e6 * Since(start));
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab->size(); ++id) {
          if ((mask[size_t(id) / 32] >> (id % 32)) & 1) allowed.push_back(id);
        }
        std::erase_if(allowed, [&](int32_t id) { return std::find(eos.begin(), eos.end(), id) != eos.end(); });
        if (allowed.empty()) break;
        const int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
        start = Clock::now();
        if (!m.AcceptToken(pick)) std::abort();
        accept_us.push_back(1e6 * Since(start));
      }
    }
    const auto ms = duet::bench::Summarize(mask_us);
    std::sort(mask_us.begin(), mask_us.end());
    const double p99 = mask_us[std::min(mask_us.size() - 1, size_t(0.99 * double(mask_us.size())))];
    double sum = 0;
    for (double us : mask_us) sum += us;
    std::printf("| %s | %.2f | %.1f | %.1f | %.1f | %.1f | %.0f | %.2f |\n", name.c_str(), build_ms, cache_ms, ms.median,
                p99, sum / double(mask_us.size()), mask_us.back(), duet::bench::Summarize(accept_us).median);
  }
}

// The tokens one engine step produced (aborts on an engine error: a benchmark has no recovery).
int64_t StepTokens(duet::LlmEngine& e) {
  absl::StatusOr<std::vector<duet::RequestOutput>> out = e.Step();
  if (!out.ok()) {
    std::fprintf(stderr, "step failed: %s\n", std::string(out.status().message()).c_str());
    std::abort();
  }
  int64_t tokens = 0;
  for (const auto& o : *out) tokens += int64_t(o.new_token_ids.size());
  return tokens;
}

// Generated tokens per second for `batch` requests of `gen_len` tokens, all submitted at once.
double DecodeTokensPerSecond(duet::LlmEngine& e, int batch, int gen_len, bool constrained, int round,
                             float temperature, duet::SpeculationMode mode = duet::SpeculationMode::kNone) {
  const std::vector<int32_t> prompt = e.tokenizer().Encode("import json\n\nrecords = [\n    {\"id\": 1, \"name\": \"a\"},\n");
  for (int i = 0; i < batch; ++i) {
    duet::SamplingParams p;
    p.temperature = temperature;
    p.seed = uint64_t(round * 1000 + i);
    p.speculation = mode;
    p.max_tokens = gen_len;
    p.ignore_eos = true;
    if (constrained) p.structured_output = {StructuredOutput::Kind::kGrammar, kJsonLinesGrammar, {}};
    if (!e.AddRequest("r" + std::to_string(i), prompt, p).ok()) std::abort();
  }
  // Prefill first (untimed), then time the decode steps.
  int64_t tokens = 0;
  while (tokens < batch) tokens += StepTokens(e);
  tokens = 0;
  const auto start = Clock::now();
  while (e.HasUnfinished()) tokens += StepTokens(e);
  const double s = Since(start);
  for (int i = 0; i < batch; ++i) e.Release("r" + std::to_string(i));
  return double(tokens) / s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Duet structured outputs: token masks and constrained decode speed"};
  std::string model_dir = DUET_MODELS_DIR "/tiny-code-llama", extra_tokenizer, backend = "cpu";
  std::vector<int> batches = {1, 8, 32};
  int gen_len = 64, repeat = 3, paths = 20, path_len = 200;
  float temperature = 0.8f;
  std::vector<std::string> spec_modes;
  std::string draft_model_dir = DUET_MODELS_DIR "/tiny-code-llama-draft";
  app.add_option("--model", model_dir);
  app.add_option("--backend", backend)->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--tokenizer", extra_tokenizer, "a tokenizer.json for a second token-mask table");
  app.add_option("--batch", batches)->delimiter(',');
  app.add_option("--gen-len", gen_len)->check(CLI::Range(2, 100000));
  app.add_option("--repeat", repeat)->check(CLI::Range(1, 100));
  app.add_option("--paths", paths)->check(CLI::Range(1, 10000));
  app.add_option("--temperature", temperature)->check(CLI::Range(0.0, 2.0));
  app.add_option("--speculation", spec_modes, "modes to compare constrained decode with: lookahead, draft, self")
      ->delimiter(',');
  app.add_option("--draft-model", draft_model_dir, "the draft model of mode draft");
  CLI11_PARSE(app, argc, argv);

  auto tokenizer = duet::Tokenizer::FromModelDir(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  BenchMasks(**tokenizer, model_dir.substr(model_dir.find_last_of('/') + 1), paths, path_len);
  if (!extra_tokenizer.empty()) {
    auto extra = duet::Tokenizer::FromFile(extra_tokenizer);
    if (!extra.ok()) {
      std::fprintf(stderr, "%s\n", std::string(extra.status().message()).c_str());
      return 1;
    }
    BenchMasks(**extra, extra_tokenizer, paths, path_len);
  }

  duet::EngineConfig config;
  config.model_dir = model_dir;
  config.backend = backend;
  config.num_kv_blocks = 4096;
  config.scheduler.max_num_seqs = 256;
  std::vector<duet::SpeculationMode> modes;
  for (const std::string& name : spec_modes) {
    absl::StatusOr<duet::SpeculationMode> mode = duet::ParseSpeculationMode(name);
    if (!mode.ok()) {
      std::fprintf(stderr, "%s\n", std::string(mode.status().message()).c_str());
      return 1;
    }
    modes.push_back(*mode);
    if (*mode == duet::SpeculationMode::kDraft) config.speculation.draft_model_dir = draft_model_dir;
  }
  auto engine = duet::CreateEngine(config);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  duet::LlmEngine& e = **engine;
  DecodeTokensPerSecond(e, 2, 8, true, 0, temperature);  // warm-up: weights paged in, the grammar's cache filled
  const std::string model_name = model_dir.substr(model_dir.find_last_of('/') + 1);
  std::printf("\n## Decode on the %s engine (%s): %d tokens per request, JSON-lines grammar, temperature %.2f, "
              "median of %d\n\n", backend.c_str(), model_name.c_str(), gen_len, double(temperature), repeat);
  std::printf("| batch | unconstrained tok/s | constrained tok/s | constrained / unconstrained |\n|---|---|---|---|\n");
  for (int batch : batches) {
    std::vector<double> free_tps, constrained_tps;
    DecodeTokensPerSecond(e, batch, gen_len, false, repeat, temperature);
    DecodeTokensPerSecond(e, batch, gen_len, true, repeat, temperature);
    for (int r = 0; r < repeat; ++r) {
      free_tps.push_back(DecodeTokensPerSecond(e, batch, gen_len, false, r, temperature));
      constrained_tps.push_back(DecodeTokensPerSecond(e, batch, gen_len, true, r, temperature));
    }
    const double f = duet::bench::Summarize(free_tps).median, c = duet::bench::Summarize(constrained_tps).median;
    std::printf("| %d | %.0f | %.0f | %.3f |\n", batch, f, c, c / f);
  }
  if (modes.empty()) return 0;
  std::printf("\n## Constrained decode with speculation (%s engine, %s): the same grammar and requests, adaptive "
              "budgets\n\n", backend.c_str(), model_name.c_str());
  std::printf("| batch | mode | constrained tok/s | with speculation tok/s | speed-up | accepted / draft | drafts |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int batch : batches) {
    for (duet::SpeculationMode mode : modes) {
      std::vector<double> plain_tps, spec_tps;
      DecodeTokensPerSecond(e, batch, gen_len, true, repeat, temperature, mode);  // untimed: step costs measured
      const duet::SpecDecodeStats before = e.Stats().spec_decode;
      for (int r = 0; r < repeat; ++r) {
        plain_tps.push_back(DecodeTokensPerSecond(e, batch, gen_len, true, r, temperature));
        spec_tps.push_back(DecodeTokensPerSecond(e, batch, gen_len, true, r, temperature, mode));
      }
      const duet::SpecDecodeStats after = e.Stats().spec_decode;
      const int64_t drafts = after.num_drafts - before.num_drafts;
      const int64_t accepted = after.num_accepted_tokens - before.num_accepted_tokens;
      const double p = duet::bench::Summarize(plain_tps).median, s = duet::bench::Summarize(spec_tps).median;
      std::printf("| %d | %s | %.0f | %.0f | %.2f | %.2f | %lld |\n", batch, duet::SpeculationModeName(mode), p, s,
                  s / p, drafts > 0 ? double(accepted) / double(drafts) : 0.0, static_cast<long long>(drafts));
    }
  }
  return 0;
}
