#include "router/http_server.h"

#include <gtest/gtest.h>

#include <mutex>

#include <atomic>
#include <functional>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <sys/socket.h>
#include <cerrno>
#include <sys/time.h>
#include <thread>

namespace duet::router {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;

// A blocking raw client: sends bytes, reads until `until` appears (or EOF).
class RawClient {
 public:
  explicit RawClient(int port) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)));
  }
  void Send(const std::string& bytes) { net::write(socket_, net::buffer(bytes)); }
  std::string ReadUntil(const std::string& until) {
    while (data_.find(until) == std::string::npos) {
      char buf[4096];
      boost::system::error_code ec;
      size_t n = socket_.read_some(net::buffer(buf), ec);
      if (ec) break;
      data_.append(buf, n);
    }
    std::string out = data_;
    const size_t end = data_.find(until);
    data_ = end == std::string::npos ? "" : data_.substr(end + until.size());
    return end == std::string::npos ? out : out.substr(0, end + until.size());
  }
  void Close() { socket_.close(); }
  // Reads until the server closes the connection (true) or `limit` passes without it (false).
  bool WaitForServerClose(std::chrono::seconds limit) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(limit.count());
    ::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    for (;;) {  // recv(2) itself: Asio's blocking reads poll past SO_RCVTIMEO
      char buf[4096];
      const ssize_t n = ::recv(socket_.native_handle(), buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
      data_.append(buf, static_cast<size_t>(n));
    }
  }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  std::string data_;
};

class HttpServerTest : public ::testing::Test {
 protected:
  void Start(HttpServerOptions options = {}) {
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
  std::atomic<int> cancelled_{0};
  std::shared_ptr<HttpResponder> hung_;
};

TEST_F(HttpServerTest, KeepAliveRequests) {
  Start();
  RawClient c(server_->port());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nX-Test: hdr\r\nContent-Length: 3\r\n\r\nabc");
  std::string r1 = c.ReadUntil("abc hdr");
  EXPECT_NE(r1.find("HTTP/1.1 200 OK"), std::string::npos) << r1;
  EXPECT_NE(r1.find("Content-Length: 12"), std::string::npos) << r1;
  c.Send("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r2 = c.ReadUntil("{}");
  EXPECT_NE(r2.find("HTTP/1.1 404"), std::string::npos) << r2;
}

TEST_F(HttpServerTest, ChunkedStream) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r = c.ReadUntil("0\r\n\r\n");
  EXPECT_NE(r.find("Transfer-Encoding: chunked"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Type: text/event-stream"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"), std::string::npos) << r;
}

TEST_F(HttpServerTest, BodyTooLargeIs413) {
  HttpServerOptions options;
  options.max_body_bytes = 1000;
  Start(options);
  RawClient c(server_->port());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'a'));
  std::string r = c.ReadUntil("}}");
  EXPECT_NE(r.find("HTTP/1.1 413"), std::string::npos) << r;
  EXPECT_NE(r.find("request_too_large"), std::string::npos) << r;
}

TEST_F(HttpServerTest, AddedHeadersGoWithWholeAndStreamedResponses) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /headers HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string r = c.ReadUntil("whole");
  EXPECT_NE(r.find("\r\nX-Request-Id: abc\r\n"), std::string::npos) << r;
  RawClient s(server_->port());
  s.Send("POST /headers HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  r = s.ReadUntil("0\r\n\r\n");
  const size_t header_end = r.find("\r\n\r\n");
  EXPECT_LT(r.find("\r\nX-Request-Id: abc\r\n"), header_end) << r;
  EXPECT_NE(r.find("data: 1"), std::string::npos) << r;
}

// Requests the server answers itself, before any handler: reported through on_rejected (for the
// HTTP metrics), with the path and method when the header was read.
TEST_F(HttpServerTest, RejectedRequestsAreReported) {
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
    RawClient c(server_->port());
    c.Send("POST /echo?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'a'));
    EXPECT_NE(c.ReadUntil("}}").find("HTTP/1.1 413"), std::string::npos);
  }
  {
    RawClient c(server_->port());
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

TEST_F(HttpServerTest, MalformedRequestIs400AndServerStaysUp) {
  Start();
  {
    RawClient c(server_->port());
    c.Send("NOT HTTP AT ALL\r\n\r\n");
    std::string r = c.ReadUntil("}}");
    EXPECT_NE(r.find("HTTP/1.1 400"), std::string::npos) << r;
  }
  RawClient c(server_->port());
  c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
  EXPECT_NE(c.ReadUntil("ok ").find("200 OK"), std::string::npos);
}

TEST_F(HttpServerTest, HandlerExceptionIs500) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /throw HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(c.ReadUntil("}}").find("HTTP/1.1 500"), std::string::npos);
}

TEST_F(HttpServerTest, DisconnectCancels) {
  Start();
  RawClient c(server_->port());
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
TEST_F(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  Start();
  RawClient c(server_->port());
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
TEST_F(HttpServerTest, DisconnectWithPipelinedRequestCancels) {
  Start();
  RawClient c(server_->port());
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
TEST_F(HttpServerTest, PipelineDepthIsBoundedAndTheConnectionCloses) {
  HttpServerOptions options;
  options.max_pipelined_requests = 2;
  Start(options);
  RawClient c(server_->port());
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
TEST_F(HttpServerTest, PipelinedBadRequestIsAnsweredInItsTurn) {
  HttpServerOptions options;
  options.max_body_bytes = 100;
  Start(options);
  RawClient c(server_->port());
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

TEST_F(HttpServerTest, StopCancelsOpenResponses) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 200 && hung_ == nullptr; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  server_->Stop();
  EXPECT_EQ(cancelled_.load(), 1);
}

// A header that trickles in is cut off at the read timeout (from the request's first byte), not
// at the much longer idle timeout of a keep-alive connection.
TEST_F(HttpServerTest, SlowHeaderIsClosedAtTheReadTimeout) {
  HttpServerOptions options;
  options.read_timeout = std::chrono::milliseconds(200);
  options.idle_timeout = std::chrono::minutes(10);
  Start(options);
  RawClient c(server_->port());
  c.Send("GET /echo HTTP/1.1\r\nHo");  // and no more
  EXPECT_TRUE(c.WaitForServerClose(std::chrono::seconds(20)));
  EXPECT_TRUE(WaitUntil([&] { return server_->num_connections() == 0; }));
}

// An HTTP/1.0 client knows no chunked encoding: a streamed response is its bytes as they are,
// ended by closing the connection.
TEST_F(HttpServerTest, StreamToAnHttp10ClientIsNotChunked) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /stream HTTP/1.0\r\n\r\n");
  const std::string r = c.ReadUntil(std::string(1, '\0'));  // to EOF
  EXPECT_EQ(r.find("Transfer-Encoding"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\ndata: 1\n\ndata: 2\n\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 9), "data: 2\n\n") << r;
  // A whole response to HTTP/1.0 keeps its Content-Length and closes too.
  RawClient d(server_->port());
  d.Send("POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi");
  const std::string e = d.ReadUntil(std::string(1, '\0'));
  EXPECT_NE(e.find("Content-Length: 8\r\nConnection: close\r\n"), std::string::npos) << e;
}

}  // namespace
}  // namespace duet::router
