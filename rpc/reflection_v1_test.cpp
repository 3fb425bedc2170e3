#include "rpc/reflection_v1.h"

#include <set>
#include <string>

#include "absl/synchronization/notification.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "rpc/rpc_util.h"

namespace duet::rpc {
namespace {

namespace v1 = grpc::reflection::v1;

struct Served {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::ServerReflection::Stub> stub;
};

Served Serve(ReflectionV1Relay* relay) {
  Served served;
  int port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer("127.0.0.1:0", {}, &port, nullptr, 0, relay);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return served;
  served.server = *std::move(server);
  served.stub = v1::ServerReflection::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  return served;
}

// A v1 client on one stream: the services, then a file by symbol, then one that does not exist.
// (The answers come from gRPC's v1alpha service; this binary cannot hold v1alpha's generated
// messages too, which libgrpc++_reflection already registers.)
TEST(ReflectionV1Test, AV1ClientGetsItsAnswersOnOneStream) {
  ReflectionV1Relay relay;
  Served served = Serve(&relay);
  ASSERT_NE(served.stub, nullptr);
  grpc::ClientContext context;
  auto stream = served.stub->ServerReflectionInfo(&context);

  v1::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  v1::ServerReflectionResponse reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_list_services_response()) << reply.DebugString();
  std::set<std::string> services;
  for (const v1::ServiceResponse& s : reply.list_services_response().service()) services.insert(s.name());
  EXPECT_TRUE(services.count("grpc.health.v1.Health")) << reply.DebugString();
  EXPECT_TRUE(services.count("grpc.reflection.v1alpha.ServerReflection")) << reply.DebugString();
  EXPECT_EQ(reply.original_request().list_services(), "");

  v1::ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol("grpc.health.v1.Health");
  ASSERT_TRUE(stream->Write(symbol));
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_file_descriptor_response()) << reply.DebugString();
  EXPECT_GT(reply.file_descriptor_response().file_descriptor_proto_size(), 0);
  EXPECT_EQ(reply.original_request().file_containing_symbol(), "grpc.health.v1.Health");

  v1::ServerReflectionRequest missing;
  missing.set_file_containing_symbol("no.such.Symbol");
  ASSERT_TRUE(stream->Write(missing));
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_error_response()) << reply.DebugString();
  EXPECT_EQ(reply.error_response().error_code(), int(grpc::StatusCode::NOT_FOUND));

  ASSERT_TRUE(stream->WritesDone());
  EXPECT_FALSE(stream->Read(&reply));
  EXPECT_TRUE(stream->Finish().ok());
  served.server->Shutdown();
}

// Methods no service serves are still UNIMPLEMENTED with the relay as the generic service.
TEST(ReflectionV1Test, OtherMethodsStayUnimplemented) {
  ReflectionV1Relay relay;
  Served served = Serve(&relay);
  ASSERT_NE(served.stub, nullptr);
  auto channel = served.server->InProcessChannel(grpc::ChannelArguments());
  grpc::GenericStub generic(channel);
  grpc::ClientContext context;
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), reply;
  grpc::Status status;
  absl::Notification done;
  generic.UnaryCall(&context, "/no.such.Service/Method", grpc::StubOptions(), &request, &reply,
                    [&](grpc::Status s) {
                      status = s;
                      done.Notify();
                    });
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  served.server->Shutdown();
}

// A client that cancels mid-stream ends both streams (the server shuts down without waiting).
TEST(ReflectionV1Test, ACancelledStreamEnds) {
  ReflectionV1Relay relay;
  Served served = Serve(&relay);
  ASSERT_NE(served.stub, nullptr);
  grpc::ClientContext context;
  auto stream = served.stub->ServerReflectionInfo(&context);
  v1::ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  v1::ServerReflectionResponse reply;
  ASSERT_TRUE(stream->Read(&reply));
  context.TryCancel();
  EXPECT_FALSE(stream->Read(&reply));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  served.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  served.server->Wait();
}

}  // namespace
}  // namespace duet::rpc
