// KV transfer throughput over UCX loopback next to memcpy of the same bytes, and the latency
// of one small layer send. Usage: kv_transfer_bench [--runs=N] [--max-tokens=N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvtransfer/layer_copy_plan.h"
#include "kvtransfer/testing_pools.h"
#include "kvtransfer/ucx_transport.h"

namespace duet::kvtransfer {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Waits for receiver callbacks.
class Signals {
 public:
  ReceiverCallbacks callbacks() {
    ReceiverCallbacks callbacks;
    callbacks.on_layer_received = [this](uint64_t, uint32_t) {
      absl::MutexLock lock(&mu_);
      ++layers_;
    };
    callbacks.on_request_done = [this](uint64_t, const absl::Status& status, MemoryKind) {
      absl::MutexLock lock(&mu_);
      if (!status.ok()) std::fprintf(stderr, "transfer failed: %s\n", status.ToString().c_str());
      ++done_;
    };
    callbacks.on_blocks_released = [](const ReleasedLease&) {};
    return callbacks;
  }
  void WaitLayers(int count) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n > 0; }, &layers_));
    layers_ -= count;
  }
  void WaitDone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n > 0; }, &done_));
    --done_;
  }

 private:
  absl::Mutex mu_;
  int layers_ = 0;
  int done_ = 0;
};

struct Transport {
  const char* name;
  HostTransport host_transport;
};
constexpr Transport kTransports[] = {{"tcp", HostTransport::kNetwork}, {"shm", HostTransport::kSharedMemory}};

struct Endpoints {
  Signals signals;
  std::unique_ptr<KvReceiver> receiver;
  std::unique_ptr<KvSender> sender;
  PeerId peer = 0;
};

std::unique_ptr<Endpoints> Connect(HostKvPools& src, HostKvPools& dst, const Transport& t) {
  auto endpoints = std::make_unique<Endpoints>();
  auto receiver = CreateUcxKvReceiver(dst.memory(), endpoints->signals.callbacks());
  auto sender = CreateUcxKvSender(src.memory(),
                                  {.operation_timeout = absl::Seconds(60),
                                   .host_transport = t.host_transport});
  if (!receiver.ok() || !sender.ok()) {
    std::fprintf(stderr, "setup failed: %s %s\n", receiver.status().ToString().c_str(),
                 sender.status().ToString().c_str());
    std::exit(1);
  }
  endpoints->receiver = std::move(*receiver);
  endpoints->sender = std::move(*sender);
  absl::StatusOr<PeerId> peer = endpoints->sender->Connect(endpoints->receiver->descriptor());
  if (!peer.ok()) {
    std::fprintf(stderr, "connect failed: %s\n", peer.status().ToString().c_str());
    std::exit(1);
  }
  endpoints->peer = *peer;
  return endpoints;
}

// Sends every layer of one request and waits until the receiver has completed it.
void TransferRequest(Endpoints& e, const KvLayout& layout, uint64_t request_id, uint32_t tokens,
                     const std::vector<uint32_t>& ids) {
  if (!e.receiver->Expect({.request_id = request_id, .num_tokens = tokens, .dst_block_ids = ids})
           .ok()) {
    std::exit(1);
  }
  std::vector<std::future<absl::Status>> sends;
  for (uint32_t layer = 0; layer < layout.num_layers; ++layer) {
    sends.push_back(e.sender->SendLayer(e.peer, {.request_id = request_id, .layer = layer,
                                                 .num_tokens = tokens, .src_block_ids = ids,
                                                 .dst_block_ids = ids}));
  }
  if (!e.sender->Finish(e.peer, request_id).get().ok()) std::exit(1);
  e.signals.WaitDone();
}

struct Case {
  const char* name;
  KvLayout layout;
  uint32_t tokens;
};

void RunThroughput(const Case& c, int runs) {
  const uint32_t blocks = (c.tokens + c.layout.block_size - 1) / c.layout.block_size;
  HostKvPools src(c.layout, blocks, /*seed=*/1);
  HostKvPools dst(c.layout, blocks, /*seed=*/0);
  std::vector<uint32_t> ids(blocks);
  for (uint32_t i = 0; i < blocks; ++i) ids[i] = i;
  const double bytes = 2.0 * c.layout.num_layers * blocks * c.layout.BlockBytes();

  std::printf("| %-24s | %6u | %9.1f |", c.name, c.tokens, bytes / (1 << 20));
  for (const Transport& t : kTransports) {
    auto e = Connect(src, dst, t);
    std::vector<double> seconds;
    for (int run = -1; run < runs; ++run) {  // run -1 warms up
      const auto start = Clock::now();
      TransferRequest(*e, c.layout, run + 100, c.tokens, ids);
      if (run >= 0) seconds.push_back(SecondsSince(start));
    }
    std::printf(" %8.2f |", bytes / Median(seconds) / 1e9);
    if (std::memcmp(src.key(c.layout.num_layers - 1), dst.key(c.layout.num_layers - 1),
                    size_t{blocks} * c.layout.BlockBytes()) != 0) {
      std::fprintf(stderr, "bytes differ after transfer\n");
      std::exit(1);
    }
  }
  // memcpy of the same ranges between the same pools.
  const std::vector<CopyRange> plan = *PlanLayerCopy(c.layout, ids, c.layout, ids, c.tokens);
  std::vector<double> seconds;
  for (int run = -1; run < runs; ++run) {
    const auto start = Clock::now();
    for (uint32_t layer = 0; layer < c.layout.num_layers; ++layer) {
      for (const CopyRange& r : plan) {
        std::memcpy(dst.key(layer) + r.dst_offset, src.key(layer) + r.src_offset, r.bytes);
        std::memcpy(dst.value(layer) + r.dst_offset, src.value(layer) + r.src_offset, r.bytes);
      }
    }
    if (run >= 0) seconds.push_back(SecondsSince(start));
  }
  std::printf(" %8.2f |\n", bytes / Median(seconds) / 1e9);
  std::fflush(stdout);
}

void RunLatency(int iterations) {
  const KvLayout layout{1, 16, 2, 64, KvDtype::kFloat32};  // one tiny-model layer, one block
  HostKvPools src(layout, 4, 1);
  HostKvPools dst(layout, 4, 0);
  std::printf("\nSingle-layer send latency (1 layer, 16 tokens, %zu bytes K+V), median of %d:\n",
              2 * layout.BlockBytes(), iterations);
  std::printf("| transport | send completed (us) | receiver notified (us) |\n");
  std::printf("|-----------|---------------------|------------------------|\n");
  for (const Transport& t : kTransports) {
    auto e = Connect(src, dst, t);
    std::vector<double> completed, notified;
    for (int i = -10; i < iterations; ++i) {
      const uint64_t id = 1000 + i;
      if (!e->receiver->Expect({.request_id = id, .num_tokens = 16, .dst_block_ids = {2}}).ok()) {
        std::exit(1);
      }
      const auto start = Clock::now();
      auto sent = e->sender->SendLayer(e->peer, {.request_id = id, .layer = 0, .num_tokens = 16,
                                                 .src_block_ids = {1}, .dst_block_ids = {2}});
      if (!sent.get().ok()) std::exit(1);
      const double send_us = SecondsSince(start) * 1e6;
      e->signals.WaitLayers(1);
      const double notify_us = SecondsSince(start) * 1e6;
      if (i >= 0) {
        completed.push_back(send_us);
        notified.push_back(notify_us);
      }
      if (!e->sender->Finish(e->peer, id).get().ok()) std::exit(1);
      e->signals.WaitDone();
    }
    std::printf("| %-9s | %19.1f | %22.1f |\n", t.name, Median(completed), Median(notified));
  }
}

}  // namespace
}  // namespace duet::kvtransfer

int main(int argc, char** argv) {
  using duet::kvtransfer::KvDtype;
  using duet::kvtransfer::KvLayout;
  int runs = 5;
  uint32_t max_tokens = 8192;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--runs=", 7) == 0) {
      runs = std::max(1, std::atoi(argv[i] + 7));
    } else if (std::strncmp(argv[i], "--max-tokens=", 13) == 0) {
      max_tokens = static_cast<uint32_t>(std::atoi(argv[i] + 13));
    } else {
      std::fprintf(stderr, "usage: %s [--runs=N] [--max-tokens=N]\n", argv[0]);
      return 2;
    }
  }
  const KvLayout llama8b{32, 16, 8, 128, KvDtype::kBFloat16};
  const KvLayout tiny{2, 16, 2, 64, KvDtype::kFloat32};  // tiny-code-llama on the CPU backend
  const duet::kvtransfer::Case cases[] = {
      {"llama-3-8b bf16 blk16", llama8b, 512},  {"llama-3-8b bf16 blk16", llama8b, 2048},
      {"llama-3-8b bf16 blk16", llama8b, 8192}, {"tiny-code-llama f32", tiny, 128},
      {"tiny-code-llama f32", tiny, 2048},
  };
  std::printf("KV transfer over UCX loopback (one request, all layers, K+V), median of %d runs "
              "after a warm-up, GB/s = 1e9 B/s\n", runs);
  std::printf("| %-24s | %6s | %9s | %8s | %8s | %8s |\n", "shape", "tokens", "MiB", "UCX tcp",
              "UCX shm", "memcpy");
  std::printf("|--------------------------|--------|-----------|----------|----------|----------|\n");
  for (const auto& c : cases) {
    if (c.tokens <= max_tokens) duet::kvtransfer::RunThroughput(c, runs);
  }
  duet::kvtransfer::RunLatency(200);
  return 0;
}
