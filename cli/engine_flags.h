// Engine flags shared by every command that runs a model (generate, serve, the workers).
#pragma once

#include "CLI/CLI.hpp"
#include "engine/llm_engine.h"

namespace duet {

// Engine flags shared by every command that runs a model.
struct EngineFlags {
  duet::EngineConfig* config;
  double kv_cache_gib = 1.0;
  double host_kv_cache_gib = 0.0;
  std::string speculation = "none";

  void Add(CLI::App* app, bool model_required = true) {
    auto* model = app->add_option("--model", config->model_dir, "Hugging Face model directory");
    if (model_required) model->required();
    // The commands default to the GPU when there is one (EngineConfig's own default is cpu).
    config->backend = "auto";
    app->add_option("--backend", config->backend, "auto (cuda when a GPU is visible, else cpu), cpu or cuda")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    app->add_option("--block-size", config->block_size, "Tokens per KV-cache block")->check(CLI::Range(1, 1024));
    app->add_option("--num-kv-blocks", config->num_kv_blocks, "KV-cache blocks (default: from --kv-cache-gib)")
        ->check(CLI::Range(1, 1 << 28))
        ->default_str("");
    app->add_option("--kv-cache-gib", kv_cache_gib, "cpu: KV-cache memory in GiB")->check(CLI::Range(0.001, 4096.0));
    app->add_option("--gpu-memory-utilization", config->gpu_memory_utilization,
                    "cuda: fraction of the GPU's memory this process may use; the KV cache gets what the "
                    "weights and activations leave (like vLLM)")
        ->check(CLI::Range(0.01, 1.0));
    // On by default, as in vLLM.
    config->enable_prefix_caching = true;
    app->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", config->enable_prefix_caching,
                  "Reuse the KV of cached prompt prefixes (on by default)");
    app->add_option("--host-kv-cache-gib", host_kv_cache_gib,
                    "Host memory in GiB for KV blocks evicted from the cache (prefix caching's second tier; 0: none)")
        ->check(CLI::Range(0.0, 65536.0));
    app->add_option("--max-num-seqs", config->scheduler.max_num_seqs, "Requests per batch")->check(CLI::Range(1, 65536));
    app->add_option("--max-num-batched-tokens", config->scheduler.max_num_batched_tokens, "Tokens per step")
        ->check(CLI::Range(1, 1 << 24));
    app->add_option("--max-num-mixed-tokens", config->scheduler.max_num_mixed_tokens,
                    "Tokens per step while requests decode (their tokens and the prompt chunks beside them; at "
                    "least one a decoding request), when below --max-num-batched-tokens: shorter gaps between "
                    "tokens and prompts spread over "
                    "steps, while a step with nothing decoding still takes --max-num-batched-tokens (default 0: "
                    "--max-num-batched-tokens)")
        ->check(CLI::Range(0, 1 << 24));
    app->add_flag("--async-scheduling,!--no-async-scheduling", config->async_scheduling,
                  "cuda: launch each step before the previous step's tokens reach the host, so the GPU does not "
                  "wait while the host schedules (on by default; steps of requests that sample on the host run "
                  "one at a time)");
    app->add_flag("--late-scheduling,!--no-late-scheduling", config->late_scheduling,
                  "with async scheduling in a server: plan the next step when the running step is halfway, so "
                  "requests that arrive meanwhile join it (on by default)");
    app->add_option("--max-model-len", config->scheduler.max_model_len, "Context limit (default: the model's)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
        ->default_str("");
    config->scheduler.max_model_len = 0;
    app->add_option("--speculation", speculation,
                    "Default speculative decoding for requests that do not choose (the request field "
                    "'speculation' overrides it)")
        ->check(CLI::IsMember({"none", "lookahead", "draft", "self"}));
    app->add_option("--draft-model", config->speculation.draft_model_dir,
                    "Draft model directory (same tokenizer) for speculation 'draft'");
    app->add_option("--self-spec-layers", config->speculation.self_spec_layers,
                    "Target layers that draft for speculation 'self' (default: half)")
        ->check(CLI::Range(1, 1024))
        ->default_str("");
    app->add_option("--max-draft-tokens", config->speculation.max_draft_tokens,
                    "Most draft tokens per request and step (the adaptive budget decides below it)")
        ->check(CLI::Range(0, 63));
    app->add_option("--sp-ranks", config->sequence_parallel.ranks,
                    "Sequence-parallel prefill ranks (ring attention; cpu: threads of this process)")
        ->check(CLI::Range(1, 64));
    app->add_option("--sp-min-tokens", config->sequence_parallel.min_tokens,
                    "Prompts of at least this many tokens prefill sequence-parallel (with --sp-ranks > 1)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
    app->add_option("--devices", config->sequence_parallel.devices,
                    "cuda: the GPU of each sequence-parallel rank, rank 0 first (e.g. 0,1,2,3; a GPU may "
                    "repeat); default: rank 0 on GPU 0 and the other ranks virtual on it")
        ->delimiter(',')
        ->check(CLI::Range(0, 1023));
    app->add_option("--sp-transport", config->sequence_parallel.transport,
                    "cuda, with --devices: how ranks pass ring blocks: peer (device copies; GPUs may repeat) or "
                    "nccl (one rank per GPU)")
        ->check(CLI::IsMember({"peer", "nccl"}));
  }
  void Finish() {
    config->kv_cache_bytes = static_cast<int64_t>(kv_cache_gib * double(1ull << 30));
    config->host_kv_cache_bytes = static_cast<int64_t>(host_kv_cache_gib * double(1ull << 30));
    config->speculation.default_mode = *duet::ParseSpeculationMode(speculation);  // checked by IsMember
  }
};


}  // namespace duet
