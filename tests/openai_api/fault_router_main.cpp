// A router in front of a broken decode worker, for the OpenAI API client tests: an in-process
// fake prefill worker and a decode worker whose streams carry two tokens and then a message that
// is no GenerateResponse, and then nothing (router/fake_workers.h), behind a real router with the
// HTTP API. Clients see HTTP 500 (non-streaming) or an SSE error event after the first chunks.
// Usage: openai_fault_router --model DIR   (prints DUET_HTTP_READY port=N, DUET_READY port=N)
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <string>

#include "router/fake_workers.h"
#include "router/router.h"

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--model") {
    std::fprintf(stderr, "usage: %s --model DIR\n", argv[0]);
    return 2;
  }
  // Before any thread starts, so that every thread leaves SIGINT/SIGTERM to RunRouter's sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  duet::router::testing::FakePrefillWorker prefill;
  duet::router::testing::MalformedDecodeWorker decode;
  decode.fault = duet::router::testing::MalformedDecodeWorker::Fault::kUnparsable;
  decode.good_messages = 2;
  duet::router::testing::FakeServer prefill_server(&prefill);
  duet::router::testing::FakeServer decode_server(&decode);

  duet::router::RouterOptions options;
  options.model_dir = argv[2];
  options.http_port = 0;
  options.prefill_addresses = {prefill_server.address()};
  options.decode_addresses = {decode_server.address()};
  return duet::router::RunRouter(options);
}
