#include "router/http_server.h"

#include "tests/tls/test_certs.h"

#include <gtest/gtest.h>

#include <mutex>

#include <atomic>
#include <functional>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/write.hpp>
#include <sys/socket.h>
#include <cerrno>
#include <sys/time.h>
#include <thread>

namespace duet::router {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;

// A blocking raw client, plain or TLS: sends bytes, reads until `until` appears (or the end).
class RawClient {
 public:
  // `tls` null: plain TCP; else a TLS client with that context (handshake done here).
  RawClient(int port, net::ssl::context* tls = nullptr) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)));
    if (tls != nullptr) {
      tls_ = std::make_unique<net::ssl::stream<tcp::socket&>>(socket_, *tls);
      tls_->handshake(net::ssl::stream_base::client, handshake_error_);
    }
  }
  const boost::system::error_code& handshake_error() const { return handshake_error_; }
  void Send(const std::string& bytes) {
    boost::system::error_code ec;
    if (tls_ != nullptr) {
      net::write(*tls_, net::buffer(bytes), ec);
    } else {
      net::write(socket_, net::buffer(bytes), ec);
    }
  }
  std::string ReadUntil(const std::string& until) {
    while (data_.find(until) == std::string::npos) {
      char buf[4096];
      boost::system::error_code ec;
      size_t n = tls_ != nullptr ? tls_->read_some(net::buffer(buf), ec) : socket_.read_some(net::buffer(buf), ec);
      if (ec) {
        last_error_ = ec;
        break;
      }
      data_.append(buf, n);
    }
    std::string out = data_;
    const size_t end = data_.find(until);
    data_ = end == std::string::npos ? "" : data_.substr(end + until.size());
    return end == std::string::npos ? out : out.substr(0, end + until.size());
  }
  // The error that ended the last ReadUntil (eof: the server closed; over TLS, after its
  // close_notify).
  const boost::system::error_code& last_error() const { return last_error_; }
  void Close() { socket_.close(); }
  // Reads until the server closes the connection (true) or `limit` passes without it (false).
  bool WaitForServerClose(std::chrono::seconds limit) {
    bool closed = false;
    char buf[4096];
    std::function<void()> read = [&] {
      auto on_read = [&](boost::system::error_code ec, size_t n) {
        if (ec) {
          closed = ec != net::error::operation_aborted;
          return;
        }
        data_.append(buf, n);
        read();
      };
      if (tls_ != nullptr) {
        tls_->async_read_some(net::buffer(buf), on_read);
      } else {
        socket_.async_read_some(net::buffer(buf), on_read);
      }
    };
    ioc_.restart();
    read();
    ioc_.run_for(limit);
    if (!ioc_.stopped()) {  // the limit passed: end the read before its buffer goes
      socket_.close();
      ioc_.restart();
      ioc_.run();
    }
    return closed;
  }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  std::unique_ptr<net::ssl::stream<tcp::socket&>> tls_;
  boost::system::error_code handshake_error_, last_error_;
  std::string data_;
};

// A test PKI (tests/tls/test_certs.h) and a client context that trusts its CA, presenting
// `cert` when given.
const testing::TestPki& Pki() {
  static const testing::TestPki* pki = new testing::TestPki(testing::MakeTestPki());
  return *pki;
}

std::unique_ptr<net::ssl::context> ClientContext(const testing::TestCert* cert = nullptr,
                                                 const std::string& ca = Pki().ca_pem) {
  auto ctx = std::make_unique<net::ssl::context>(net::ssl::context::tls_client);
  ctx->add_certificate_authority(net::buffer(ca));
  ctx->set_verify_mode(net::ssl::verify_peer);
  if (cert != nullptr) {
    ctx->use_certificate_chain(net::buffer(cert->cert_pem));
    ctx->use_private_key(net::buffer(cert->key_pem), net::ssl::context::pem);
  }
  return ctx;
}

rpc::TlsMaterial ServerTls(rpc::ClientCertMode client_certs = rpc::ClientCertMode::kNone) {
  rpc::TlsMaterial tls;
  tls.cert_chain_pem = Pki().server.cert_pem;
  tls.private_key_pem = Pki().server.key_pem;
  if (client_certs != rpc::ClientCertMode::kNone) tls.ca_pem = Pki().ca_pem;
  tls.client_certs = client_certs;
  return tls;
}

// Every behaviour of the server, over plain HTTP and over TLS (the parameter).
class HttpServerTest : public ::testing::TestWithParam<bool> {
 protected:
  HttpServerTest() {
    if (GetParam()) tls_ = ClientContext();
  }
  void Start(HttpServerOptions options = {}) {
    if (GetParam()) options.tls = ServerTls();
    auto server = HttpServer::Start(options, [this](HttpRequest request, std::shared_ptr<HttpResponder> r) {
      if (request.path == "/echo") {
        r->Respond(200, "text/plain", request.method + " " + request.body + " " + request.Header("x-test"));
      } else if (request.path == "/stream") {
        r->StartStream(200, "text/event-stream");
        r->Write("data: 1\n\n");
        r->Write("data: 2\n\n");
        r->End();
      } else if (request.path == "/hang") {  // never answers; the cancel callback counts
        r->SetCancelHandler([this] { cancelled_++; });
        hung_ = r;
      } else if (request.path == "/headers") {  // AddHeader, then a whole response (GET) or a stream
        r->AddHeader("X-Request-Id", "abc");
        if (request.method == "GET") {
          r->Respond(200, "text/plain", "whole");
        } else {
          r->StartStream(200, "text/event-stream");
          r->Write("data: 1\n\n");
          r->End();
        }
      } else if (request.path == "/throw") {
        throw std::runtime_error("boom");
      } else {
        r->Respond(404, "application/json", "{}");
      }
    });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }

  std::unique_ptr<HttpServer> server_;
  std::unique_ptr<net::ssl::context> tls_;  // the clients', with TLS
  std::atomic<int> cancelled_{0};
  std::shared_ptr<HttpResponder> hung_;
};

INSTANTIATE_TEST_SUITE_P(PlainAndTls, HttpServerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tls" : "Plain"; });

TEST_P(HttpServerTest, KeepAliveRequests) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nX-Test: hdr\r\nContent-Length: 3\r\n\r\nabc");
  std::string r1 = c.ReadUntil("abc hdr");
  EXPECT_NE(r1.find("HTTP/1.1 200 OK"), std::string::npos) << r1;
  EXPECT_NE(r1.find("Content-Length: 12"), std::string::npos) << r1;
  c.Send("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r2 = c.ReadUntil("{}");
  EXPECT_NE(r2.find("HTTP/1.1 404"), std::string::npos) << r2;
}

TEST_P(HttpServerTest, ChunkedStream) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r = c.ReadUntil("0\r\n\r\n");
  EXPECT_NE(r.find("Transfer-Encoding: chunked"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Type: text/event-stream"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"), std::string::npos) << r;
}

TEST_P(HttpServerTest, BodyTooLargeIs413) {
  HttpServerOptions options;
  options.max_body_bytes = 1000;
  Start(options);
  RawClient c(server_->port(), tls_.get());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'a'));
  std::string r = c.ReadUntil("}}");
  EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
  EXPECT_NE(r.find("request_too_large"), std::string::npos) << r;
}

TEST_P(HttpServerTest, AddedHeadersGoWithWholeAndStreamedResponses) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /headers HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r = c.ReadUntil("whole");
  EXPECT_NE(r.find("\r\nX-Request-Id: abc\r\n"), std::string::npos) << r;
  RawClient s(server_->port(), tls_.get());
  s.Send("POST /headers HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  r = s.ReadUntil("0\r\n\r\n");
  const size_t header_end = r.find("\r\n\r\n");
  EXPECT_LT(r.find("\r\nX-Request-Id: abc\r\n"), header_end) << r;
  EXPECT_NE(r.find("data: 1"), std::string::npos) << r;
}

// Requests the server answers itself, before any handler: reported through on_rejected (for the
// HTTP metrics), with the path and method when the header was read.
TEST_P(HttpServerTest, RejectedRequestsAreReported) {
  struct Rejected {
    std::string path, method;
    int status;
  };
  std::mutex mu;
  std::vector<Rejected> rejected;
  HttpServerOptions options;
  options.max_body_bytes = 1000;
  options.on_rejected = [&](const std::string& path, const std::string& method, int status, double seconds) {
    EXPECT_GE(seconds, 0.0);
    std::lock_guard<std::mutex> lock(mu);
    rejected.push_back({path, method, status});
  };
  Start(options);
  {
    RawClient c(server_->port(), tls_.get());
    c.Send("POST /echo?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'a'));
    EXPECT_NE(c.ReadUntil("}}").find("HTTP/1.1 413"), std::string::npos);
  }
  {
    RawClient c(server_->port(), tls_.get());
    c.Send("NOT HTTP AT ALL\r\n\r\n");
    EXPECT_NE(c.ReadUntil("}}").find("HTTP/1.1 400"), std::string::npos);
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(rejected.size(), 2u);
  EXPECT_EQ(rejected[0].path, "/echo");
  EXPECT_EQ(rejected[0].method, "POST");
  EXPECT_EQ(rejected[0].status, 413);
  EXPECT_EQ(rejected[1].path, "");
  EXPECT_EQ(rejected[1].status, 400);
}

TEST_P(HttpServerTest, MalformedRequestIs400AndServerStaysUp) {
  Start();
  {
    RawClient c(server_->port(), tls_.get());
    c.Send("NOT HTTP AT ALL\r\n\r\n");
    std::string r = c.ReadUntil("}}");
    EXPECT_NE(r.find("HTTP/1.1 400"), std::string::npos) << r;
  }
  RawClient c(server_->port(), tls_.get());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
  EXPECT_NE(c.ReadUntil("ok ").find("200 OK"), std::string::npos);
}

TEST_P(HttpServerTest, HandlerExceptionIs500) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /throw HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(c.ReadUntil("}}").find("HTTP/1.1 500"), std::string::npos);
}

TEST_P(HttpServerTest, DisconnectCancels) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 200 && hung_ == nullptr; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  c.Close();
  for (int i = 0; i < 400 && cancelled_ == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(cancelled_.load(), 1);
  EXPECT_TRUE(hung_->cancelled());
  hung_->Respond(200, "text/plain", "late");  // a no-op now
}

std::string Echo(const std::string& body, const std::string& extra_headers = "") {
  return "POST /echo HTTP/1.1\r\nHost: x\r\n" + extra_headers + "Content-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

bool WaitUntil(const std::function<bool()>& condition) {
  for (int i = 0; i < 400 && !condition(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return condition();
}

// HTTP/1.1 pipelining: requests sent back to back on one connection, the first answered late,
// are all answered, in the order they came.
TEST_P(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n" + Echo("one") + Echo("two") + Echo("three"));
  ASSERT_TRUE(WaitUntil([&] { return hung_ != nullptr; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are read meanwhile
  hung_->Respond(200, "text/plain", "first");
  const std::string r = c.ReadUntil("POST three ");
  const size_t first = r.find("first"), one = r.find("POST one "), two = r.find("POST two "),
               three = r.find("POST three ");
  ASSERT_NE(first, std::string::npos) << r;
  ASSERT_NE(one, std::string::npos) << r;
  ASSERT_NE(two, std::string::npos) << r;
  ASSERT_NE(three, std::string::npos) << r;
  EXPECT_LT(first, one);
  EXPECT_LT(one, two);
  EXPECT_LT(two, three);
  EXPECT_EQ(cancelled_.load(), 0);
  // Still a keep-alive connection.
  c.Send(Echo("four"));
  EXPECT_NE(c.ReadUntil("POST four ").find("200 OK"), std::string::npos);
}

// A client that pipelines a request behind one being answered and then leaves: the answer in
// progress is cancelled (its work can stop), like any other disconnect.
TEST_P(HttpServerTest, DisconnectWithPipelinedRequestCancels) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n" + Echo("next"));
  ASSERT_TRUE(WaitUntil([&] { return hung_ != nullptr; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the pipelined request is read
  c.Close();
  EXPECT_TRUE(WaitUntil([&] { return cancelled_ == 1; }));
  EXPECT_TRUE(hung_->cancelled());
  EXPECT_TRUE(WaitUntil([&] { return server_->num_connections() == 0; }));
}

// At most max_pipelined_requests wait behind the one being answered: the last of them is answered
// with "Connection: close" and the connection then closes (the client retries the rest, as
// HTTP/1.1 says). Until then the server still notices the client leaving.
TEST_P(HttpServerTest, PipelineDepthIsBoundedAndTheConnectionCloses) {
  HttpServerOptions options;
  options.max_pipelined_requests = 2;
  Start(options);
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n" + Echo("1") + Echo("2") + Echo("3") + Echo("4"));
  ASSERT_TRUE(WaitUntil([&] { return hung_ != nullptr; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  hung_->Respond(200, "text/plain", "first");
  const std::string r = c.ReadUntil(std::string(1, '\0'));  // to EOF
  EXPECT_NE(r.find("first"), std::string::npos) << r;
  EXPECT_NE(r.find("POST 1 "), std::string::npos) << r;
  EXPECT_NE(r.find("POST 2 "), std::string::npos) << r;
  EXPECT_EQ(r.find("POST 3 "), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close\r\n\r\nPOST 2 "), std::string::npos) << r;
}

// An error found in a pipelined request (here a body over the limit) is answered in its turn.
TEST_P(HttpServerTest, PipelinedBadRequestIsAnsweredInItsTurn) {
  HttpServerOptions options;
  options.max_body_bytes = 100;
  Start(options);
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n" + Echo(std::string(500, 'z')));
  ASSERT_TRUE(WaitUntil([&] { return hung_ != nullptr; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  hung_->Respond(200, "text/plain", "first");
  const std::string r = c.ReadUntil(std::string(1, '\0'));
  const size_t first = r.find("first"), too_large = r.find("HTTP/1.1 413");
  ASSERT_NE(first, std::string::npos) << r;
  ASSERT_NE(too_large, std::string::npos) << r;
  EXPECT_LT(first, too_large);
}

TEST_P(HttpServerTest, StopCancelsOpenResponses) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 200 && hung_ == nullptr; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  server_->Stop();
  EXPECT_EQ(cancelled_.load(), 1);
}

// A header that trickles in is cut off at the read timeout (from the request's first byte), not
// at the much longer idle timeout of a keep-alive connection.
TEST_P(HttpServerTest, SlowHeaderIsClosedAtTheReadTimeout) {
  HttpServerOptions options;
  options.read_timeout = std::chrono::milliseconds(200);
  options.idle_timeout = std::chrono::minutes(10);
  Start(options);
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /echo HTTP/1.1\r\nHo");  // and no more
  EXPECT_TRUE(c.WaitForServerClose(std::chrono::seconds(20)));
  EXPECT_TRUE(WaitUntil([&] { return server_->num_connections() == 0; }));
}

// An HTTP/1.0 client knows no chunked encoding: a streamed response is its bytes as they are,
// ended by closing the connection.
TEST_P(HttpServerTest, StreamToAnHttp10ClientIsNotChunked) {
  Start();
  RawClient c(server_->port(), tls_.get());
  c.Send("GET /stream HTTP/1.0\r\n\r\n");
  const std::string r = c.ReadUntil(std::string(1, '\0'));  // to EOF
  EXPECT_EQ(r.find("Transfer-Encoding"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\ndata: 1\n\ndata: 2\n\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 9), "data: 2\n\n") << r;
  // A whole response to HTTP/1.0 keeps its Content-Length and closes too.
  RawClient d(server_->port(), tls_.get());
  d.Send("POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi");
  const std::string e = d.ReadUntil(std::string(1, '\0'));
  EXPECT_NE(e.find("Content-Length: 8\r\nConnection: close\r\n"), std::string::npos) << e;
}


// What only TLS has: handshakes that fail, client certificates, close_notify.
class TlsHttpServerTest : public ::testing::Test {
 protected:
  void Start(HttpServerOptions options) {
    auto server = HttpServer::Start(options, [](HttpRequest request, std::shared_ptr<HttpResponder> r) {
      if (request.path == "/stream") {
        r->StartStream(200, "text/event-stream");
        r->Write("data: 1\n\n");
        r->End();
        return;
      }
      r->Respond(200, "text/plain", request.method + " " + request.body + " ");
    });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  // A request over TLS with `client`'s context: the response, or "" when the connection failed.
  std::string Exchange(net::ssl::context& client) {
    RawClient c(server_->port(), &client);
    if (c.handshake_error()) return "";
    c.Send(Echo("hi"));
    return c.ReadUntil("POST hi ");
  }
  bool Works(net::ssl::context& client) { return Exchange(client).find("200 OK") != std::string::npos; }

  std::unique_ptr<HttpServer> server_;
};

// A client that speaks plain HTTP to the TLS port gets a plaintext 400 that says why; one that
// sends bytes that are neither is disconnected; the server goes on serving TLS clients.
TEST_F(TlsHttpServerTest, PlainClientsOnTheTlsPortFailCleanly) {
  std::atomic<int> rejected{0};
  HttpServerOptions options;
  options.tls = ServerTls();
  options.on_rejected = [&](const std::string&, const std::string&, int status, double) {
    if (status == 400) rejected++;
  };
  Start(options);
  {
    RawClient plain(server_->port());
    plain.Send(Echo("hi"));
    const std::string r = plain.ReadUntil(std::string(1, '\0'));  // to EOF
    EXPECT_NE(r.find("HTTP/1.1 400"), std::string::npos) << r;
    EXPECT_NE(r.find("this port speaks HTTPS"), std::string::npos) << r;
  }
  EXPECT_EQ(rejected.load(), 1);
  {
    RawClient garbage(server_->port());
    garbage.Send(std::string("\x16\x03\x01\x00\x05garbage-that-is-no-client-hello", 37));
    EXPECT_TRUE(garbage.WaitForServerClose(std::chrono::seconds(20)));
  }
  auto client = ClientContext();
  EXPECT_TRUE(Works(*client));
  EXPECT_TRUE(WaitUntil([&] { return server_->num_connections() == 0; }));
}

// A client that connects and never finishes its handshake is closed at the read timeout.
TEST_F(TlsHttpServerTest, AStalledHandshakeIsClosedAtTheReadTimeout) {
  HttpServerOptions options;
  options.tls = ServerTls();
  options.read_timeout = std::chrono::milliseconds(200);
  options.idle_timeout = std::chrono::minutes(10);
  Start(options);
  RawClient c(server_->port());
  c.Send(std::string("\x16\x03\x01", 3));  // the first bytes of a record, and no more
  EXPECT_TRUE(c.WaitForServerClose(std::chrono::seconds(20)));
  EXPECT_TRUE(WaitUntil([&] { return server_->num_connections() == 0; }));
}

// --ssl-cert-reqs 2: only clients with a certificate the CA signed; 1: those, or none at all.
TEST_F(TlsHttpServerTest, ClientCertificates) {
  auto anonymous = ClientContext();
  auto signed_by_ca = ClientContext(&Pki().client);
  auto signed_by_another = ClientContext(&Pki().other_client);
  {
    HttpServerOptions options;
    options.tls = ServerTls(rpc::ClientCertMode::kRequired);
    Start(options);
    EXPECT_TRUE(Works(*signed_by_ca));
    EXPECT_FALSE(Works(*anonymous));
    EXPECT_FALSE(Works(*signed_by_another));
    EXPECT_TRUE(Works(*signed_by_ca));
    server_->Stop();
  }
  HttpServerOptions options;
  options.tls = ServerTls(rpc::ClientCertMode::kOptional);
  Start(options);
  EXPECT_TRUE(Works(*signed_by_ca));
  EXPECT_TRUE(Works(*anonymous));
  EXPECT_FALSE(Works(*signed_by_another));
}

// A client that does not trust the server's CA refuses it.
TEST_F(TlsHttpServerTest, AClientOfAnotherCaRefusesTheServer) {
  HttpServerOptions options;
  options.tls = ServerTls();
  Start(options);
  auto other = ClientContext(nullptr, Pki().other_ca_pem);
  RawClient c(server_->port(), other.get());
  EXPECT_TRUE(c.handshake_error());
}

// A response that ends with the connection (HTTP/1.0 here) ends with close_notify, so the client
// can tell the end of the body from a cut connection.
TEST_F(TlsHttpServerTest, TheServerClosesWithCloseNotify) {
  HttpServerOptions options;
  options.tls = ServerTls();
  Start(options);
  auto client = ClientContext();
  RawClient c(server_->port(), client.get());
  c.Send("GET /stream HTTP/1.0\r\n\r\n");
  const std::string r = c.ReadUntil(std::string(1, '\0'));
  EXPECT_EQ(r.substr(r.size() - 9), "data: 1\n\n") << r;
  EXPECT_EQ(c.last_error(), net::error::eof) << c.last_error().message();  // not ssl stream_truncated
}

}  // namespace
}  // namespace duet::router
