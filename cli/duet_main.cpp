// duet: the command-line entry point.
#include <cstdio>

#include "CLI/CLI.hpp"
#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"Duet: disaggregated LLM serving"};
  app.require_subcommand(1);

  duet::GenerateOptions gen;
  double kv_cache_gib = 1.0;
  CLI::App* generate = app.add_subcommand("generate", "Offline batch generation (JSONL in, JSONL out)");
  generate->add_option("--model", gen.engine.model_dir, "Hugging Face model directory")->required();
  generate->add_option("--input", gen.input_path, "Input JSONL, one request per line")->required();
  generate->add_option("--output", gen.output_path, "Output JSONL")->required();
  generate->add_option("--backend", gen.engine.backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  generate->add_option("--block-size", gen.engine.block_size, "Tokens per KV-cache block")->check(CLI::Range(1, 1024));
  generate->add_option("--num-kv-blocks", gen.engine.num_kv_blocks, "KV-cache blocks (default: from --kv-cache-gib)")
      ->check(CLI::Range(1, 1 << 28));
  generate->add_option("--kv-cache-gib", kv_cache_gib, "KV-cache memory in GiB")->check(CLI::Range(0.001, 4096.0));
  generate->add_option("--max-num-seqs", gen.engine.scheduler.max_num_seqs, "Requests per batch")->check(CLI::Range(1, 65536));
  generate->add_option("--max-num-batched-tokens", gen.engine.scheduler.max_num_batched_tokens, "Tokens per step")
      ->check(CLI::Range(1, 1 << 24));
  generate->add_option("--max-model-len", gen.engine.scheduler.max_model_len, "Context limit (default: the model's)");
  gen.engine.scheduler.max_model_len = 0;

  duet::TokenizeOptions tok;
  CLI::App* tokenize = app.add_subcommand("tokenize", "Tokenize texts (JSONL {\"text\"} → {\"ids\"})");
  tokenize->add_option("--model", tok.model_dir, "Model directory with tokenizer.json")->required();
  tokenize->add_option("--input", tok.input_path, "Input JSONL")->required();
  tokenize->add_option("--output", tok.output_path, "Output JSONL")->required();

  CLI11_PARSE(app, argc, argv);
  if (generate->parsed()) {
    gen.engine.kv_cache_bytes = static_cast<int64_t>(kv_cache_gib * (1ull << 30));
    return duet::RunGenerate(gen);
  }
  if (tokenize->parsed()) return duet::RunTokenize(tok);
  return 1;
}
