// A cluster's processes coming and going: `duet serve` restarts a dead worker on its port and
// stops when its router dies; SIGTERM drains (running streams finish, new work is turned away,
// health says NOT_SERVING) in `duet serve`, the router and the workers.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;
using grpc::health::v1::HealthCheckResponse;
using testing::LocalCluster;
using testing::RunGenerate;
using testing::StreamResult;

const std::string kModel = testing::ModelsDir() + "/tiny-code-llama";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A process of a `duet serve` cluster, as /proc shows it.
struct Child {
  pid_t pid = 0;
  std::vector<std::string> argv;
  std::string environ;  // NUL-separated
  std::string role() const { return argv.size() > 1 ? argv[1] : ""; }
  std::string Flag(const std::string& name) const {
    for (size_t i = 0; i + 1 < argv.size(); ++i) {
      if (argv[i] == name) return argv[i + 1];
    }
    return "";
  }
  std::optional<std::string> Env(const std::string& name) const {
    for (const std::string& entry : std::vector<std::string>(absl::StrSplit(environ, '\0', absl::SkipEmpty()))) {
      if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
    }
    return std::nullopt;
  }
};

std::vector<Child> ChildrenOf(pid_t parent) {
  std::vector<Child> out;
  DIR* proc = opendir("/proc");
  while (dirent* e = proc != nullptr ? readdir(proc) : nullptr) {
    const pid_t pid = pid_t(std::atoi(e->d_name));
    if (pid <= 0) continue;
    const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string state;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != parent || state == "Z") continue;
    Child c;
    c.pid = pid;
    c.argv = absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/cmdline")), '\0', absl::SkipEmpty());
    c.environ = ReadFile(absl::StrCat("/proc/", pid, "/environ"));
    out.push_back(std::move(c));
  }
  if (proc != nullptr) closedir(proc);
  return out;
}

std::optional<Child> ChildWithRole(pid_t parent, const std::string& role) {
  for (Child& c : ChildrenOf(parent)) {
    if (c.role() == role) return c;
  }
  return std::nullopt;
}

// `duet serve` on the CPU, gRPC on a free port, no HTTP.
struct Serve {
  std::unique_ptr<Subprocess> process;
  int grpc_port = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Duet::Stub> stub;
  std::string error;

  explicit Serve(std::vector<std::string> extra = {}, const std::string& backend = "cpu") {
    std::vector<std::string> argv = {testing::DuetBinary(), "serve", "--model", kModel, "--backend", backend,
                                     "--grpc-port", "0", "--http-port", "-1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(argv);
    if (!p.ok()) {
      error = std::string(p.status().message());
      return;
    }
    process = *std::move(p);
    absl::StatusOr<std::string> port = process->WaitForLine("DUET_READY grpc_port=", std::chrono::seconds(120));
    if (!port.ok()) {
      error = std::string(port.status().message());
      return;
    }
    grpc_port = std::atoi(port->c_str());
    channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", grpc_port), grpc::InsecureChannelCredentials());
    stub = v1::Duet::NewStub(channel);
  }
  ~Serve() {
    if (process != nullptr) process->Stop(std::chrono::seconds(40));
  }
  bool ok() const { return stub != nullptr; }
};

v1::GenerateRequest Request(int max_tokens, const std::string& text = "def fib(n):\n") {
  v1::GenerateRequest r;
  r.set_text(text);
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

// The first successful request within `limit`; how long it took to get there.
std::optional<Clock::duration> FirstSuccessWithin(v1::Duet::Stub& stub, Clock::duration limit) {
  const auto start = Clock::now();
  while (Clock::now() - start < limit) {
    StreamResult r = RunGenerate(stub, Request(4), 0, 3000);
    if (r.status.ok() && r.token_ids.size() == 4) return Clock::now() - start;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return std::nullopt;
}

int PortOf(const std::string& address) { return std::atoi(address.substr(address.rfind(':') + 1).c_str()); }

// --decode-devices / --prefill-devices place workers on GPUs: refused on the cpu backend, and a
// device past serve's own CUDA_VISIBLE_DEVICES is refused (cuda, or auto) before any worker
// starts (cli/worker_placement.h).
TEST(ServeTest, WorkerDevicesAreCheckedBeforeAnyWorkerStarts) {
  for (const char* flag : {"--decode-devices", "--prefill-devices"}) {
    for (const auto& [backend, visible] : {std::pair{"cpu", "0,1"}, std::pair{"cuda", "0"}, std::pair{"auto", "0"}}) {
      absl::StatusOr<std::unique_ptr<Subprocess>> p =
          Subprocess::Start({testing::DuetBinary(), "serve", "--model", kModel, "--backend", backend, "--grpc-port",
                             "0", "--http-port", "-1", flag, "1"},
                            {{"CUDA_VISIBLE_DEVICES", visible}});
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ((*p)->Wait(std::chrono::seconds(30)), 2) << flag << " " << backend;
    }
  }
}

// --http-port 0: serve announces the port the router's HTTP API really took (issue 18).
TEST(ServeTest, HttpPortZeroIsAnnouncedWithTheRealPort) {
  absl::StatusOr<std::unique_ptr<Subprocess>> p =
      Subprocess::Start({testing::DuetBinary(), "serve", "--model", kModel, "--backend", "cpu", "--grpc-port", "0",
                         "--http-port", "0"});
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> http = (*p)->WaitForLine("DUET_HTTP_READY port=", std::chrono::seconds(120));
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = std::atoi(http->c_str());
  EXPECT_GT(port, 0);
  EXPECT_TRUE((*p)->WaitForLine("DUET_READY grpc_port=", std::chrono::seconds(30)).ok());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << "nothing listens on " << port;
  close(fd);
  (*p)->Stop(std::chrono::seconds(40));
}

TEST(ServeSupervisionTest, AKilledPrefillWorkerIsRestartedOnItsPortAndRequestsSucceedAgain) {
  Serve serve;
  ASSERT_TRUE(serve.ok()) << serve.error;
  ASSERT_TRUE(FirstSuccessWithin(*serve.stub, std::chrono::seconds(10)).has_value());
  const std::optional<Child> router = ChildWithRole(serve.process->pid(), "router");
  ASSERT_TRUE(router.has_value());
  const int prefill_port = PortOf(router->Flag("--prefill"));  // the router's static address list

  for (int restart = 1; restart <= 2; ++restart) {
    const std::optional<Child> prefill = ChildWithRole(serve.process->pid(), "prefill-worker");
    ASSERT_TRUE(prefill.has_value());
    ASSERT_EQ(::kill(prefill->pid, SIGKILL), 0);
    const std::optional<Clock::duration> back = FirstSuccessWithin(*serve.stub, std::chrono::seconds(30));
    ASSERT_TRUE(back.has_value()) << "requests still fail 30 s after the prefill worker was killed";
    EXPECT_LT(*back, std::chrono::seconds(15));
    const std::optional<Child> restarted = ChildWithRole(serve.process->pid(), "prefill-worker");
    ASSERT_TRUE(restarted.has_value());
    EXPECT_NE(restarted->pid, prefill->pid);
    EXPECT_EQ(restarted->Flag("--port"), std::to_string(prefill_port));
    // Counted where an operator (or a test) sees it.
    absl::StatusOr<std::string> line =
        serve.process->WaitForLine("DUET_WORKER_RESTARTED role=prefill index=0 ", std::chrono::seconds(5));
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_NE(line->find(absl::StrCat("port=", prefill_port)), std::string::npos) << *line;
    EXPECT_NE(line->find(absl::StrCat("restarts=", restart)), std::string::npos) << *line;
  }
  EXPECT_EQ(ChildWithRole(serve.process->pid(), "router")->pid, router->pid);  // undisturbed
}

TEST(ServeSupervisionTest, AKilledDecodeWorkerIsRestartedToo) {
  Serve serve;
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::optional<Child> decode = ChildWithRole(serve.process->pid(), "decode-worker");
  ASSERT_TRUE(decode.has_value());
  ASSERT_EQ(::kill(decode->pid, SIGKILL), 0);
  ASSERT_TRUE(FirstSuccessWithin(*serve.stub, std::chrono::seconds(30)).has_value());
  absl::StatusOr<std::string> line =
      serve.process->WaitForLine("DUET_WORKER_RESTARTED role=decode index=0 ", std::chrono::seconds(5));
  EXPECT_TRUE(line.ok()) << line.status();
}

TEST(ServeSupervisionTest, ServeExitsWithAnErrorWhenItsRouterDies) {
  Serve serve;
  ASSERT_TRUE(serve.ok()) << serve.error;
  const pid_t serve_pid = serve.process->pid();
  const std::optional<Child> router = ChildWithRole(serve_pid, "router");
  ASSERT_TRUE(router.has_value());
  ASSERT_EQ(::kill(router->pid, SIGKILL), 0);
  const int status = serve.process->Wait(std::chrono::seconds(20));
  EXPECT_NE(status, Subprocess::kStillRunning);
  EXPECT_NE(status, 0);
  EXPECT_TRUE(ChildrenOf(serve_pid).empty());
}

// The token serve makes for its cluster reaches every child in the environment, not in argv
// (where `ps` shows it), and the workers require it.
TEST(ServeSupervisionTest, ServeGivesItsChildrenAGeneratedInternalToken) {
  Serve serve;
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::vector<Child> children = ChildrenOf(serve.process->pid());
  ASSERT_EQ(children.size(), 3u);
  std::string token;
  for (const Child& c : children) {
    for (const std::string& entry : std::vector<std::string>(absl::StrSplit(c.environ, '\0', absl::SkipEmpty()))) {
      if (entry.rfind("DUET_INTERNAL_TOKEN=", 0) != 0) continue;
      const std::string value = entry.substr(20);
      EXPECT_EQ(value.size(), 64u) << c.role();
      if (token.empty()) token = value;
      EXPECT_EQ(value, token) << c.role();
    }
    for (const std::string& arg : c.argv) EXPECT_EQ(arg.find(token.empty() ? "\x01" : token), std::string::npos);
  }
  ASSERT_FALSE(token.empty());
  const std::optional<Child> decode = ChildWithRole(serve.process->pid(), "decode-worker");
  const std::optional<Child> router = ChildWithRole(serve.process->pid(), "router");
  auto stub = v1::DecodeWorker::NewStub(grpc::CreateChannel(router->Flag("--decode"), grpc::InsecureChannelCredentials()));
  for (const char* t : {static_cast<const char*>(nullptr), token.c_str()}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (t != nullptr) ctx.AddMetadata("x-duet-internal-token", t);
    v1::WorkerStats stats;
    EXPECT_EQ(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code(),
              t == nullptr ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::OK);
  }
  ASSERT_TRUE(FirstSuccessWithin(*serve.stub, std::chrono::seconds(10)).has_value());
}

// --internal-token-file: the cluster's token is the file's (a tool outside serve, such as the
// chaos benchmark, can then ask the workers for their stats); an unreadable file stops serve.
TEST(ServeSupervisionTest, InternalTokenFileIsTheClustersToken) {
  const std::string path = ::testing::TempDir() + "/serve_internal_token";
  {
    std::ofstream out(path);
    out << "chaos-bench-token\n";
  }
  Serve serve({"--internal-token-file", path});
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::optional<Child> router = ChildWithRole(serve.process->pid(), "router");
  ASSERT_TRUE(router.has_value());
  auto stub = v1::DecodeWorker::NewStub(grpc::CreateChannel(router->Flag("--decode"), grpc::InsecureChannelCredentials()));
  for (const char* t : {"another-token", "chaos-bench-token"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("x-duet-internal-token", t);
    v1::WorkerStats stats;
    EXPECT_EQ(stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code(),
              std::string(t) == "chaos-bench-token" ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);
  }
  ASSERT_TRUE(FirstSuccessWithin(*serve.stub, std::chrono::seconds(10)).has_value());

  absl::StatusOr<std::unique_ptr<Subprocess>> missing =
      Subprocess::Start({testing::DuetBinary(), "serve", "--model", kModel, "--backend", "cpu", "--grpc-port", "0",
                         "--http-port", "-1", "--internal-token-file", path + ".missing"});
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ((*missing)->Wait(std::chrono::seconds(30)), 1);
}

// Under MPS a prefill worker's kernels yield to the decode worker's, and --prefill-gpu-percent /
// --decode-gpu-percent cap each role's SMs: serve sets each in that role's workers' environment
// only (no effect without MPS).
TEST(ServeSupervisionTest, WorkersGetTheirMpsPriorityAndShare) {
  Serve serve({"--prefill-gpu-percent", "70", "--decode-gpu-percent", "45"});
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::vector<Child> children = ChildrenOf(serve.process->pid());
  ASSERT_EQ(children.size(), 3u);
  for (const Child& c : children) {
    const bool prefill = c.role() == "prefill-worker";
    EXPECT_EQ(c.Env("CUDA_MPS_CLIENT_PRIORITY"), prefill ? std::optional<std::string>("1") : std::nullopt)
        << c.role();
    EXPECT_EQ(c.Env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
              prefill                        ? std::optional<std::string>("70")
              : c.role() == "decode-worker" ? std::optional<std::string>("45")
                                            : std::nullopt)
        << c.role();
  }
}

// --prefill-devices / --decode-devices reach each worker as its CUDA_VISIBLE_DEVICES, its GPU
// first (backend auto: the cpu one here, where no GPU is visible; the GPU where one is).
TEST(ServeSupervisionTest, PlacedWorkersGetTheirGpuFirstInTheirEnvironment) {
  Serve serve({"--prefill-devices", "0", "--decode-devices", "0"}, "auto");
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::vector<Child> children = ChildrenOf(serve.process->pid());
  ASSERT_EQ(children.size(), 3u);
  for (const Child& c : children) {
    const std::optional<std::string> visible = c.Env("CUDA_VISIBLE_DEVICES");
    // Device 0 is the first of the test's own CUDA_VISIBLE_DEVICES when that is set.
    const char* ours = getenv("CUDA_VISIBLE_DEVICES");
    if (c.role() == "router") {  // inherits serve's
      EXPECT_EQ(visible, ours == nullptr ? std::nullopt : std::optional<std::string>(ours));
    } else {
      ASSERT_TRUE(visible.has_value()) << c.role();
      const std::string first = ours == nullptr ? "0" : std::string(ours).substr(0, std::string(ours).find(','));
      EXPECT_EQ(visible->substr(0, visible->find(',')), first) << c.role() << ": " << *visible;
    }
  }
}

// The step budgets reach the workers: --max-num-mixed-tokens every worker's engine, and
// --decode-max-num-batched-tokens the decode workers' in place of --max-num-batched-tokens.
TEST(ServeSupervisionTest, StepBudgetsReachTheWorkers) {
  Serve serve({"--max-num-batched-tokens", "512", "--decode-max-num-batched-tokens", "256", "--max-num-mixed-tokens",
               "48"});
  ASSERT_TRUE(serve.ok()) << serve.error;
  const std::vector<Child> children = ChildrenOf(serve.process->pid());
  ASSERT_EQ(children.size(), 3u);
  for (const Child& c : children) {
    if (c.role() == "router") continue;
    EXPECT_EQ(c.Flag("--max-num-mixed-tokens"), "48") << c.role();
    EXPECT_EQ(c.Flag("--max-num-batched-tokens"), c.role() == "decode-worker" ? "256" : "512") << c.role();
  }
  ASSERT_TRUE(FirstSuccessWithin(*serve.stub, std::chrono::seconds(10)).has_value());
}

// ---- Drain ----

HealthCheckResponse::ServingStatus Health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  HealthCheckResponse resp;
  if (!stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok()) return HealthCheckResponse::UNKNOWN;
  return resp.status();
}

bool BecomesNotServing(const std::shared_ptr<grpc::Channel>& channel) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    if (Health(channel) == HealthCheckResponse::NOT_SERVING) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Streams running in the background; `started` counts those that have their first tokens.
struct Streams {
  std::atomic<int> started{0};
  std::vector<std::future<StreamResult>> results;

  // `context_lines` lines of code before each prompt make the prefill longer.
  void Start(v1::Duet::Stub& stub, int n, int max_tokens, int context_lines = 0) {
    for (int i = 0; i < n; ++i) {
      std::string prompt = absl::StrCat("# stream ", i, "\n");
      for (int line = 0; line < context_lines; ++line) absl::StrAppend(&prompt, "value_", line, " = compute(", i, ")\n");
      absl::StrAppend(&prompt, "def f", i, "(x):\n");
      results.push_back(std::async(std::launch::async, [this, &stub, prompt, max_tokens] {
        StreamResult result;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(240));
        auto reader = stub.Generate(&ctx, Request(max_tokens, prompt));
        v1::GenerateResponse msg;
        while (reader->Read(&msg)) {
          if (result.messages++ == 0) started.fetch_add(1);
          result.token_ids.insert(result.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
          if (msg.finished()) result.finish_reason = msg.finish_reason();
        }
        result.status = reader->Finish();
        return result;
      }));
    }
  }
  bool AllStartedWithin(std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    while (started.load() < int(results.size())) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }
  // Every stream completes in full.
  void ExpectAllComplete(int max_tokens) {
    for (size_t i = 0; i < results.size(); ++i) {
      StreamResult r = results[i].get();
      EXPECT_TRUE(r.status.ok()) << "stream " << i << ": " << r.status.error_message();
      EXPECT_EQ(r.finish_reason, "length") << "stream " << i;
      EXPECT_EQ(int(r.token_ids.size()), max_tokens) << "stream " << i;
    }
  }
};

StreamResult NewRequest(v1::Duet::Stub& stub) { return RunGenerate(stub, Request(4), 0, 5000); }

// Each role's drain runs under 50 streams (issue 17: 50 of 50 complete within the grace period).
constexpr int kDrainStreams = 50;

TEST(DrainTest, SigtermToServeLetsRunningStreamsFinishAndTurnsNewOnesAway) {
  constexpr int kStreams = kDrainStreams;
  constexpr int kTokens = 160;
  Serve serve({"--shutdown-grace-seconds", "60"});
  ASSERT_TRUE(serve.ok()) << serve.error;
  Streams streams;
  streams.Start(*serve.stub, kStreams, kTokens);
  ASSERT_TRUE(streams.AllStartedWithin(std::chrono::seconds(60)));
  const auto signalled = Clock::now();
  serve.process->Signal(SIGTERM);
  EXPECT_TRUE(BecomesNotServing(serve.channel));
  StreamResult rejected = NewRequest(*serve.stub);
  EXPECT_EQ(rejected.status.error_code(), grpc::StatusCode::UNAVAILABLE) << rejected.status.error_message();
  int finished_before = 0;
  for (auto& f : streams.results) finished_before += f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  EXPECT_LT(finished_before, kStreams / 2) << "the streams were too short to test a drain";
  streams.ExpectAllComplete(kTokens);
  const int status = serve.process->Wait(std::chrono::seconds(60));
  EXPECT_EQ(status, 0);
  EXPECT_LT(Clock::now() - signalled, std::chrono::seconds(60));
}

// The router alone: gRPC and HTTP both turn new requests away (UNAVAILABLE / 503) while its
// streams finish; then it exits 0.
int HttpStatus(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  (void)::write(fd, request.data(), request.size());
  char buf[64] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n < 12) return -1;
  return std::atoi(buf + 9);  // "HTTP/1.1 503 ..."
}

TEST(DrainTest, SigtermToTheRouterDrainsItsStreams) {
  testing::ClusterOptions options{1, 1, {}, {"--shutdown-grace-seconds", "60"}};
  options.http = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string body = R"({"model":"tiny-code-llama","prompt":"def f(x):\n","max_tokens":4})";
  const std::string completion = absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                              "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  const std::string health = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(HttpStatus(cluster.http_port(), completion), 200);
  constexpr int kStreams = kDrainStreams;
  constexpr int kTokens = 160;
  Streams streams;
  streams.Start(cluster.router(), kStreams, kTokens);
  ASSERT_TRUE(streams.AllStartedWithin(std::chrono::seconds(60)));
  cluster.router_process().Signal(SIGTERM);
  EXPECT_TRUE(BecomesNotServing(cluster.router_channel()));
  EXPECT_EQ(NewRequest(cluster.router()).status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(HttpStatus(cluster.http_port(), completion), 503);
  EXPECT_EQ(HttpStatus(cluster.http_port(), health), 503);
  streams.ExpectAllComplete(kTokens);
  EXPECT_EQ(cluster.router_process().Wait(std::chrono::seconds(60)), 0);
}

// A decode worker stops taking reservations (the router places new requests on the other one)
// and finishes the streams it has, then exits 0.
TEST(DrainTest, SigtermToADecodeWorkerFinishesItsStreams) {
  LocalCluster cluster({1, 2, {"--shutdown-grace-seconds", "60"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_TRUE(cluster.WaitForAllWorkersUp());  // streams on both decode workers
  constexpr int kStreams = kDrainStreams;
  constexpr int kTokens = 160;
  Streams streams;
  streams.Start(cluster.router(), kStreams, kTokens);
  ASSERT_TRUE(streams.AllStartedWithin(std::chrono::seconds(60)));
  // A started stream may still be joining its worker's batch: wait until worker 0 runs one.
  std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
  for (int i = 0; i < 100 && stats.size() == 2 && stats[0].num_requests_running() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stats = cluster.DecodeStats();
  }
  ASSERT_EQ(stats.size(), 2u);
  ASSERT_GT(stats[0].num_requests_running(), 0) << "no stream on the worker to drain";
  cluster.decode_process(0).Signal(SIGTERM);
  auto worker0 = grpc::CreateChannel(cluster.worker_addresses()[0], grpc::InsecureChannelCredentials());
  EXPECT_TRUE(BecomesNotServing(worker0));
  for (int i = 0; i < 3; ++i) {  // new requests go to the other decode worker
    StreamResult r = NewRequest(cluster.router());
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  }
  streams.ExpectAllComplete(kTokens);
  EXPECT_EQ(cluster.decode_process(0).Wait(std::chrono::seconds(60)), 0);
}

// ---- Live KV migration on drain ----

// The router's duet:kv_migrations_total for `outcome` (-1: not scraped).
double KvMigrations(LocalCluster& cluster, const std::string& outcome) {
  metrics::testing::HttpResponse r =
      metrics::testing::HttpGet(uint16_t(cluster.router_metrics_port()), "/metrics", std::chrono::seconds(5));
  const std::string series = absl::StrCat("duet:kv_migrations_total{model_name=\"tiny-code-llama\",role=\"router\","
                                          "outcome=\"", outcome, "\"} ");
  const size_t at = r.status == 200 ? r.body.find(series) : std::string::npos;
  return at == std::string::npos ? -1 : std::stod(r.body.substr(at + series.size()));
}

// The greedy streams of a drain run, and the same prompts uninterrupted first.
void ExpectSameTokensAsUninterrupted(LocalCluster& cluster, Streams& drained, int n, int max_tokens) {
  Streams reference;
  reference.Start(cluster.router(), n, max_tokens);
  for (int i = 0; i < n; ++i) {
    StreamResult want = reference.results[size_t(i)].get();
    StreamResult got = drained.results[size_t(i)].get();
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    EXPECT_TRUE(got.status.ok()) << "stream " << i << ": " << got.status.error_message();
    EXPECT_EQ(got.token_ids, want.token_ids) << "stream " << i;
  }
}

// Waits until decode worker `index` runs at least one request.
bool DecodeWorkerRuns(LocalCluster& cluster, size_t index) {
  for (int i = 0; i < 200; ++i) {
    std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
    if (stats.size() > index && stats[index].num_requests_running() > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

// A draining decode worker parks its decoding streams with their KV; the router moves the KV to
// the other decode worker (no re-prefill) and the streams go on there, token for token as an
// uninterrupted run. The worker exits long before its streams would have ended.
// Not `exact` (bf16 on the GPU): batched decode is not batch-invariant there, so with random
// weights a moved stream (in another batch) drifts from the uninterrupted run after some tokens,
// and the streams are too quick to be still running when the worker has gone: the moves, their
// completion and their lengths are checked; the token-for-token check is the CPU (float32) test's.
void ExpectDrainMovesStreamsKv(const std::string& backend, const std::vector<std::string>& worker_flags,
                               bool exact, const std::vector<std::string>& router_flags = {}) {
  testing::ClusterOptions options{1, 2, worker_flags};
  options.router_flags = router_flags;
  options.backend = backend;
  options.worker_flags.insert(options.worker_flags.end(), {"--shutdown-grace-seconds", "60"});
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_TRUE(cluster.WaitForAllWorkersUp());  // streams on both decode workers
  constexpr int kStreams = 8;
  constexpr int kTokens = 600;
  Streams streams;
  streams.Start(cluster.router(), kStreams, kTokens);
  ASSERT_TRUE(streams.AllStartedWithin(std::chrono::seconds(60)));
  ASSERT_TRUE(DecodeWorkerRuns(cluster, 0)) << "no stream on the worker to drain";
  const auto signalled = Clock::now();
  cluster.decode_process(0).Signal(SIGTERM);
  EXPECT_EQ(cluster.decode_process(0).Wait(std::chrono::seconds(60)), 0);
  const auto exited = Clock::now();
  if (exact) {
    int running = 0;
    for (auto& f : streams.results) running += f.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
    EXPECT_GT(running, 0) << "the worker exited only after its streams ended ("
                          << std::chrono::duration<double>(exited - signalled).count() << " s)";
    ExpectSameTokensAsUninterrupted(cluster, streams, kStreams, kTokens);
  } else {
    streams.ExpectAllComplete(kTokens);
  }
  EXPECT_GE(KvMigrations(cluster, "moved"), 1);
  EXPECT_EQ(KvMigrations(cluster, "resumed"), 0);
  EXPECT_EQ(KvMigrations(cluster, "failed"), 0);
}

TEST(DrainTest, SigtermToADecodeWorkerMovesItsStreamsKvToTheOther) { ExpectDrainMovesStreamsKv("cpu", {}, /*exact=*/true); }

// The same for streams whose prompts the decode workers prefilled themselves (conditional
// disaggregation): once parked, they continue from their KV like the others.
TEST(DrainTest, SigtermToADecodeWorkerMovesTheKvOfStreamsItPrefilled) {
  ExpectDrainMovesStreamsKv("cpu", {}, /*exact=*/true, {"--local-prefill-max-tokens", "4096"});
}

// The same with the KV cache on the GPU (skipped without one): MigrateKv
// stages the parked blocks through pinned host memory on both sides. Three workers share the GPU.
TEST(DrainTest, CudaSigtermToADecodeWorkerMovesItsStreamsKvToTheOther) {
  if (testing::RunCommand("nvidia-smi -L > /dev/null", "/dev/null") != 0) GTEST_SKIP() << "no GPU";
  ExpectDrainMovesStreamsKv("cuda", {"--gpu-memory-utilization", "0.2"}, /*exact=*/false);
}

// With no other decode worker to take them, the parked streams go on where they were: every one
// completes as an uninterrupted run would, and then the worker exits.
TEST(DrainTest, ParkedStreamsResumeOnTheDrainingWorkerWhenNoOtherTakesThem) {
  testing::ClusterOptions options{1, 1, {"--shutdown-grace-seconds", "60"}};
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr int kStreams = 6;
  constexpr int kTokens = 300;
  Streams reference;
  reference.Start(cluster.router(), kStreams, kTokens);
  std::vector<StreamResult> want;
  for (auto& f : reference.results) want.push_back(f.get());
  Streams streams;
  streams.Start(cluster.router(), kStreams, kTokens);
  ASSERT_TRUE(streams.AllStartedWithin(std::chrono::seconds(60)));
  ASSERT_TRUE(DecodeWorkerRuns(cluster, 0));
  cluster.decode_process(0).Signal(SIGTERM);
  for (int i = 0; i < kStreams; ++i) {
    StreamResult got = streams.results[size_t(i)].get();
    EXPECT_TRUE(got.status.ok()) << "stream " << i << ": " << got.status.error_message();
    EXPECT_EQ(got.token_ids, want[size_t(i)].token_ids) << "stream " << i;
  }
  EXPECT_GE(KvMigrations(cluster, "resumed"), 1);
  EXPECT_EQ(KvMigrations(cluster, "failed"), 0);
  EXPECT_EQ(cluster.decode_process(0).Wait(std::chrono::seconds(60)), 0);
}

// The same for a prefill worker: the prompts it has are prefilled and shipped, new ones go to the
// other prefill worker.
TEST(DrainTest, SigtermToAPrefillWorkerFinishesItsWork) {
  LocalCluster cluster({2, 1, {"--shutdown-grace-seconds", "60"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  constexpr int kStreams = kDrainStreams;
  constexpr int kTokens = 40;
  Streams streams;
  streams.Start(cluster.router(), kStreams, kTokens, /*context_lines=*/40);  // ~400-token prompts
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (bool busy = false; !busy && Clock::now() < deadline;) {
    const std::vector<v1::WorkerStats> stats = cluster.PrefillStats();
    busy = !stats.empty() && stats[0].num_requests_running() + stats[0].num_requests_waiting() > 0;
    if (!busy) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_LT(Clock::now(), deadline) << "prefill worker 0 never had a prompt";
  cluster.prefill_process(0).Signal(SIGTERM);
  streams.ExpectAllComplete(kTokens);
  EXPECT_EQ(cluster.prefill_process(0).Wait(std::chrono::seconds(60)), 0);
  StreamResult after = NewRequest(cluster.router());
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
}

}  // namespace
}  // namespace duet
