#include "router/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
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

TEST_F(HttpServerTest, StopCancelsOpenResponses) {
  Start();
  RawClient c(server_->port());
  c.Send("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 200 && hung_ == nullptr; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  server_->Stop();
  EXPECT_EQ(cancelled_.load(), 1);
}

}  // namespace
}  // namespace duet::router
