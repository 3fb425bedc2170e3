#include "rpc/internal_auth.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/crypto.h"

namespace duet::rpc {
namespace {

constexpr std::string_view kOpenPrefix = "/grpc.health.v1.Health/";
// Refused while a worker drains: the calls that bring new work, and GetStats, so the router's
// poller takes the worker out of its rotation at once.
constexpr std::string_view kRefusedWhileDraining[] = {
    "/duet.v1.DecodeWorker/ReserveKv", "/duet.v1.PrefillWorker/Prefill", "/duet.v1.DecodeWorker/GetStats",
    "/duet.v1.PrefillWorker/GetStats"};

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* token) : token_(token) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kInternalTokenMetadata, *token_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const token_;  // the factory's
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&token_);
  }

 private:
  const std::string token_;
};

}  // namespace

absl::StatusOr<std::string> LoadInternalToken(const std::string& file) {
  if (file.empty()) {
    const char* env = std::getenv(kInternalTokenEnv);
    return std::string(env != nullptr ? absl::StripAsciiWhitespace(env) : "");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the internal token file ", file));
  std::stringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("the internal token file ", file, " is empty"));
  return token;
}

absl::StatusOr<std::string> GenerateInternalToken() {
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open /dev/urandom: ", std::strerror(errno)));
  char bytes[32];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      return absl::InternalError("cannot read /dev/urandom");
    }
    got += size_t(n);
  }
  ::close(fd);
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

grpc::Status WorkerCallGate::Admit(std::string_view method, const std::string_view* token) const {
  if (method.substr(0, kOpenPrefix.size()) == kOpenPrefix) return grpc::Status::OK;
  if (!token_.empty() && (token == nullptr || !ConstantTimeEquals(*token, token_))) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("internal worker RPCs need the cluster's token (metadata \"",
                                     kInternalTokenMetadata, "\"): only the router may call them"));
  }
  if (draining()) {
    for (std::string_view m : kRefusedWhileDraining) {
      if (method == m) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down and takes no new work");
      }
    }
  }
  return grpc::Status::OK;
}

std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> InternalTokenInterceptors(
    const std::string& token) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  if (!token.empty()) factories.push_back(std::make_unique<TokenInterceptorFactory>(token));
  return factories;
}

}  // namespace duet::rpc
