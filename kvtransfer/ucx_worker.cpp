#include "kvtransfer/ucx_worker.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

#include "common/check.h"

namespace duet::kvtransfer {
namespace {

constexpr char kTcpSegmentSize[] = "256k";

// How long Stop() keeps progressing while closed endpoints finish cancelling their requests.
constexpr absl::Duration kDrainLimit = absl::Seconds(2);

}  // namespace

absl::Status UcxError(ucs_status_t status, std::string_view what) {
  const std::string message = std::string(what) + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return absl::DeadlineExceededError(message);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::UnimplementedError(message);
    default:
      // Connection resets, unreachable peers and the like: the peer is unavailable.
      return absl::UnavailableError(message);
  }
}

absl::StatusOr<std::unique_ptr<UcxMemoryRegion>> UcxMemoryRegion::Register(ucp_context_h context,
                                                                           void* address,
                                                                           size_t bytes) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = address;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  ucs_status_t status = ucp_mem_map(context, &params, &memh);
  if (status != UCS_OK) return UcxError(status, "ucp_mem_map of a KV pool");

  void* rkey_buffer = nullptr;
  size_t rkey_size = 0;
  status = ucp_rkey_pack(context, memh, &rkey_buffer, &rkey_size);
  if (status != UCS_OK) {
    ucp_mem_unmap(context, memh);
    return UcxError(status, "ucp_rkey_pack of a KV pool");
  }
  std::string packed(static_cast<const char*>(rkey_buffer), rkey_size);
  ucp_rkey_buffer_release(rkey_buffer);
  return std::unique_ptr<UcxMemoryRegion>(
      new UcxMemoryRegion(context, address, bytes, memh, std::move(packed)));
}

UcxMemoryRegion::~UcxMemoryRegion() { ucp_mem_unmap(context_, memh_); }

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const Options& options) {
  // KV layers are megabytes: tcp segments of 256 KiB instead of UCX's 8 KiB default nearly double
  // the tcp put bandwidth (kv_transfer_bench). UCX reads transport options from the environment
  // only (ucp_config_modify does not reach them); an explicit UCX_TCP_*_SEG_SIZE still wins.
  static std::once_flag tcp_defaults;
  std::call_once(tcp_defaults, [] {
    setenv("UCX_TCP_TX_SEG_SIZE", kTcpSegmentSize, /*overwrite=*/0);
    setenv("UCX_TCP_RX_SEG_SIZE", kTcpSegmentSize, /*overwrite=*/0);
  });
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return UcxError(status, "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = options.name.c_str();
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) return UcxError(status, "ucp_init");

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  status = ucp_worker_create(context, &worker_params, &worker);
  if (status != UCS_OK) {
    ucp_cleanup(context);
    return UcxError(status, "ucp_worker_create");
  }

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  status = ucp_worker_get_address(worker, &address, &address_length);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker);
    ucp_cleanup(context);
    return UcxError(status, "ucp_worker_get_address");
  }
  std::string packed_address(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(worker, address);

  int worker_fd = -1;
  if (ucp_worker_get_efd(worker, &worker_fd) != UCS_OK) worker_fd = -1;
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  DUET_CHECK(wake_fd >= 0);
  return std::unique_ptr<UcxWorker>(
      new UcxWorker(options, context, worker, worker_fd, wake_fd, std::move(packed_address)));
}

UcxWorker::UcxWorker(const Options& options, ucp_context_h context, ucp_worker_h worker,
                     int worker_fd, int wake_fd, std::string address)
    : options_(options), context_(context), worker_(worker), worker_fd_(worker_fd),
      wake_fd_(wake_fd), address_(std::move(address)) {}

UcxWorker::~UcxWorker() {
  DUET_CHECK_MSG(!thread_.joinable(), "UcxWorker destroyed before Stop()");
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
  close(wake_fd_);
}

void UcxWorker::Start(std::function<bool()> tick) {
  DUET_CHECK(!thread_.joinable());
  thread_ = std::thread([this, tick = std::move(tick)] { Loop(tick); });
}

void UcxWorker::Stop(std::function<void()> shutdown, std::function<bool()> drained) {
  if (!thread_.joinable()) return;
  Post([this, shutdown = std::move(shutdown), drained = std::move(drained)]() mutable {
    shutdown();
    drained_ = std::move(drained);
    stopping_ = true;
  });
  thread_.join();
}

void UcxWorker::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    posted_.push_back(std::move(fn));
  }
  Wake();
}

void UcxWorker::Wake() {
  const uint64_t one = 1;
  // A full eventfd counter already means "wake up", so a failed write is harmless.
  (void)!write(wake_fd_, &one, sizeof(one));
}

void UcxWorker::RunPosted() {
  std::deque<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
}

void UcxWorker::Loop(std::function<bool()> tick) {
  absl::Time drain_deadline = absl::InfiniteFuture();
  absl::Time last_activity = absl::InfinitePast();
  while (true) {
    RunPosted();
    bool active = false;
    while (ucp_worker_progress(worker_) != 0) active = true;
    if (active) last_activity = absl::Now();
    if (stopping_) {
      if (drain_deadline == absl::InfiniteFuture()) drain_deadline = absl::Now() + kDrainLimit;
      if (drained_() || absl::Now() > drain_deadline) return;
      std::this_thread::yield();
      continue;
    }
    const bool in_flight = tick();
    if (in_flight || absl::Now() - last_activity < options_.spin_after_activity) {
      std::this_thread::yield();
    } else {
      WaitForEvents();
    }
  }
}

void UcxWorker::WaitForEvents() {
  const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.tick_period));
  pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
  int num_fds = 1;
  if (worker_fd_ >= 0) {
    // Arming fails with BUSY when events are already pending: go progress them now.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;
    num_fds = 2;
  }
  // Without a worker event fd nothing would wake us for incoming traffic: nap briefly instead.
  poll(fds, num_fds, worker_fd_ >= 0 ? timeout_ms : 0);
  if (worker_fd_ < 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  if (fds[0].revents & POLLIN) {
    uint64_t count = 0;
    (void)!read(wake_fd_, &count, sizeof(count));
  }
}

}  // namespace duet::kvtransfer
