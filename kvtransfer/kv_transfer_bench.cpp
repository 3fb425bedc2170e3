// KV transfer throughput over UCX loopback next to memcpy of the same bytes, the latency of one
// small layer send, and (CUDA builds, with a GPU) device-to-device transfers between two
// processes over CUDA IPC next to the device copy bandwidth of the same run.
// Usage: kv_transfer_bench [--runs=N] [--max-tokens=N]
#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvtransfer/layer_copy_plan.h"
#include "kvtransfer/testing_child.h"
#include "kvtransfer/testing_pools.h"
#include "kvtransfer/ucx_transport.h"
#ifdef DUET_HAVE_CUDA
#include "kvtransfer/testing_device_pools.h"
#endif

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

#ifdef DUET_HAVE_CUDA
// ---- Device to device between two processes (CUDA IPC) ----

const KvLayout kLlama8b{32, 16, 8, 128, KvDtype::kBFloat16};
constexpr uint32_t kDevicePoolTokens = 16384;
constexpr uint32_t kDeviceBlocks = kDevicePoolTokens / 16;

// The engine's blocks are not in order: request blocks come from a shuffled-looking but
// deterministic sequence of distinct ids (runs of 4 consecutive blocks, as a real allocator's
// free list gives), different on the two sides.
std::vector<uint32_t> EngineLikeIds(uint32_t count, uint32_t salt) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; ids.size() < count; ++i) {
    const uint32_t run = (i * 37 + salt) % (kDeviceBlocks / 4);
    for (uint32_t j = 0; j < 4 && ids.size() < count; ++j) ids.push_back(run * 4 + j);
  }
  return ids;
}

// Child role: a receiver over device pools; "expect ID TOKENS" -> "ok", then "done ID" when the
// request completes in the device pools.
int RunDeviceReceiverChild() {
  DeviceKvTestPools device(kLlama8b, kDeviceBlocks);
  HostKvPools host(kLlama8b, 1, 0);
  std::unique_ptr<DeviceKvMemory> memory = *CreateDeviceKvMemory(device.pools());
  absl::Mutex mu;
  std::vector<std::string> done;
  ReceiverCallbacks callbacks;
  callbacks.on_request_done = [&](uint64_t id, const absl::Status& status, MemoryKind landed) {
    absl::MutexLock lock(&mu);
    done.push_back(status.ok() && landed == MemoryKind::kDevice ? absl::StrCat("done ", id)
                                                                : absl::StrCat("failed ", status.ToString()));
  };
  callbacks.on_blocks_released = [](const ReleasedLease&) {};
  auto receiver = CreateUcxKvReceiver(host.memory(), callbacks, {.device = memory.get()});
  if (!receiver.ok()) return 1;
  std::printf("%s\n", absl::BytesToHexString((*receiver)->descriptor()).c_str());
  std::fflush(stdout);
  char line[256];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    std::vector<std::string> words = absl::StrSplit(absl::StripAsciiWhitespace(line), ' ');
    uint64_t id = 0;
    uint32_t tokens = 0;
    if (words.size() != 3 || !absl::SimpleAtoi(words[1], &id) || !absl::SimpleAtoi(words[2], &tokens)) return 1;
    const std::vector<uint32_t> ids = EngineLikeIds((tokens + 15) / 16, 5);
    if (!(*receiver)->Expect({.request_id = id, .num_tokens = tokens, .device_block_ids = ids}).ok()) return 1;
    std::printf("ok\n");
    std::fflush(stdout);
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](std::vector<std::string>* d) { return !d->empty(); }, &done));
    std::printf("%s\n", done.front().c_str());
    std::fflush(stdout);
    done.clear();
  }
  return 0;
}

// Seconds of `fn`'s device work on `stream`, between events around it. The stream is held at a
// gate (a host function waiting, at most a second, for the enqueueing to end) so the time is the
// device's, not the rate at which the host enqueues. Kernels load eagerly (see main): loading one
// lazily while the gate holds the stream could wait for the gate.
template <typename Fn>
double DeviceSeconds(cudaStream_t stream, Fn fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::atomic<bool> open{false};
  cudaLaunchHostFunc(
      stream,
      [](void* flag) {
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        while (!static_cast<std::atomic<bool>*>(flag)->load() && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::yield();
        }
      },
      &open);
  cudaEventRecord(start, stream);
  fn();
  cudaEventRecord(stop, stream);
  open = true;
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / 1e3;
}

void RunDeviceThroughput(int runs, uint32_t max_tokens) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("\nDevice to device (CUDA IPC): skipped, no CUDA device\n");
    return;
  }
  ChildProcess child({"DUET_KV_BENCH_CHILD=device-receiver"});
  const std::string descriptor = absl::HexStringToBytes(child.ReadLine());
  DeviceKvTestPools device(kLlama8b, kDeviceBlocks);
  HostKvPools seed(kLlama8b, kDeviceBlocks, 3);
  device.Upload(seed);
  HostKvPools host(kLlama8b, 1, 0);
  std::unique_ptr<DeviceKvMemory> memory = *CreateDeviceKvMemory(device.pools());
  auto sender = CreateUcxKvSender(host.memory(), {.operation_timeout = absl::Seconds(60), .device = memory.get()});
  absl::StatusOr<PeerId> peer = descriptor.empty() ? absl::UnavailableError("no child") : (*sender)->Connect(descriptor);
  if (!peer.ok() || (*sender)->path(*peer) != TransferPath::kCudaIpc) {
    std::fprintf(stderr, "device receiver: %s\n", peer.ok() ? "path is not cuda_ipc" : peer.status().ToString().c_str());
    std::exit(1);
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  DeviceKvTestPools local_dst(kLlama8b, kDeviceBlocks);  // for the in-process reference copies

  std::printf("\nKV transfer device to device between two processes on one GPU (llama-3-8b bf16 blk16, all\n"
              "layers K+V, blocks in runs of 4), median of %d runs after a warm-up, GB/s = 1e9 B/s:\n"
              "  cudaMemcpy: one copy of the same byte count in this process (the device copy bandwidth);\n"
              "    per layer: 32 copies of a layer's bytes each, back to back\n"
              "  copies: device time of the request's copies, queued on the producer's stream behind a gate,\n"
              "    sent layer by layer (32 sends, as a forward pass produces them) or all at once (one send:\n"
              "    a target that came after the forward pass, a kept prompt)\n"
              "  end to end: first send to the receiver process's completion (notices over UCX)\n", runs);
  std::printf("| tokens |     MiB | cudaMemcpy | per layer | by layer | / cudaMemcpy | / per layer | at once | / cudaMemcpy "
              "| end-to-end ms by layer | at once |\n");
  std::printf("|--------|---------|------------|-----------|----------|--------------|-------------|---------|--------------"
              "|------------------------|---------|\n");
  uint64_t request = 1;
  for (uint32_t tokens : {16u, 64u, 512u, 2048u, 8192u}) {
    if (tokens > max_tokens) continue;
    const uint32_t blocks = (tokens + 15) / 16;
    const std::vector<uint32_t> src_ids = EngineLikeIds(blocks, 11);
    const std::vector<uint32_t> dst_ids = EngineLikeIds(blocks, 5);
    const double bytes = 2.0 * kLlama8b.num_layers * blocks * kLlama8b.BlockBytes();
    // One request sent in sends of `layers_per_send` layers: {copies' device seconds, end to end}.
    auto transfer = [&](uint32_t layers_per_send) {
      child.Send(absl::StrCat("expect ", request, " ", tokens));
      if (child.ReadLine() != "ok") std::exit(1);
      const auto start = Clock::now();
      const double copy_seconds = DeviceSeconds(stream, [&] {
        for (uint32_t layer = 0; layer < kLlama8b.num_layers; layer += layers_per_send) {
          (void)(*sender)->SendLayer(*peer, {.request_id = request, .layer = layer, .num_layers = layers_per_send,
                                             .num_tokens = tokens, .src_block_ids = src_ids,
                                             .dst_block_ids = dst_ids, .device_stream = stream});
        }
      });
      const absl::Status finished = (*sender)->Finish(*peer, request).get();
      const std::string done = child.ReadLine();
      const double seconds = SecondsSince(start);
      if (!finished.ok() || done != absl::StrCat("done ", request)) {
        std::fprintf(stderr, "transfer failed: %s / %s\n", finished.ToString().c_str(), done.c_str());
        std::exit(1);
      }
      ++request;
      return std::pair{copy_seconds, seconds};
    };
    std::vector<double> by_layer, by_layer_e2e, at_once, at_once_e2e, memcpy_s, memcpy_layers_s;
    for (int run = -1; run < runs; ++run) {
      const auto [layer_copies, layer_e2e] = transfer(1);
      const auto [once_copies, once_e2e] = transfer(kLlama8b.num_layers);
      const double m = DeviceSeconds(stream, [&] {
        cudaMemcpyAsync(local_dst.key(0), device.key(0), size_t(bytes), cudaMemcpyDeviceToDevice, stream);
      });
      const double layer_bytes = bytes / kLlama8b.num_layers;
      const double per_layer = DeviceSeconds(stream, [&] {
        for (uint32_t layer = 0; layer < kLlama8b.num_layers; ++layer) {
          cudaMemcpyAsync(local_dst.key(0) + size_t(layer * layer_bytes), device.key(0) + size_t(layer * layer_bytes),
                          size_t(layer_bytes), cudaMemcpyDeviceToDevice, stream);
        }
      });
      if (run < 0) continue;
      memcpy_layers_s.push_back(per_layer);
      by_layer.push_back(layer_copies);
      by_layer_e2e.push_back(layer_e2e);
      at_once.push_back(once_copies);
      at_once_e2e.push_back(once_e2e);
      memcpy_s.push_back(m);
    }
    const double memcpy_gbs = bytes / Median(memcpy_s) / 1e9, per_layer_gbs = bytes / Median(memcpy_layers_s) / 1e9;
    const double layer_gbs = bytes / Median(by_layer) / 1e9, once_gbs = bytes / Median(at_once) / 1e9;
    std::printf("| %6u | %7.1f | %10.0f | %9.0f | %8.0f | %11.0f%% | %10.0f%% | %7.0f | %11.0f%% | %22.3f | %7.3f |\n",
                tokens, bytes / (1 << 20), memcpy_gbs, per_layer_gbs, layer_gbs, 100 * layer_gbs / memcpy_gbs,
                100 * layer_gbs / per_layer_gbs, once_gbs, 100 * once_gbs / memcpy_gbs, Median(by_layer_e2e) * 1e3,
                Median(at_once_e2e) * 1e3);
    std::fflush(stdout);
  }
  sender->reset();
  cudaStreamDestroy(stream);
}
#endif  // DUET_HAVE_CUDA

}  // namespace
}  // namespace duet::kvtransfer

int main(int argc, char** argv) {
#ifdef DUET_HAVE_CUDA
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/1);  // before any CUDA call (DeviceSeconds)
  if (const char* role = std::getenv("DUET_KV_BENCH_CHILD"); role != nullptr) {
    return duet::kvtransfer::RunDeviceReceiverChild();
  }
#endif
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
#ifdef DUET_HAVE_CUDA
  duet::kvtransfer::RunDeviceThroughput(runs, max_tokens);
#endif
  return 0;
}
