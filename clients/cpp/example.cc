// Calls a tokenspout server through the stubs generated from protos/: cancels a stream mid-way,
// streams a chat token by token, and reads the google.rpc details of an invalid request. Every
// call carries a deadline and, when one is given, an API key.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "tokenspout/v1/generation.grpc.pb.h"

namespace {

namespace v1 = tokenspout::v1;

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// Command-line flags: --address, --api-key, --timeout (seconds), --max-new-tokens.
struct Options {
  std::string address = EnvOr("TOKENSPOUT_ADDRESS", "127.0.0.1:50051");
  std::string api_key = EnvOr("TOKENSPOUT_API_KEY", "");
  double timeout_s = 60;
  uint32_t max_new_tokens = 64;

  static Options Parse(int argc, char** argv) {
    Options options;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i], value = argv[i + 1];
      if (flag == "--address") {
        options.address = value;
      } else if (flag == "--api-key") {
        options.api_key = value;
      } else if (flag == "--timeout") {
        options.timeout_s = std::stod(value);
      } else if (flag == "--max-new-tokens") {
        options.max_new_tokens = static_cast<uint32_t>(std::stoul(value));
      } else {
        throw std::invalid_argument("unknown flag " + flag);
      }
    }
    return options;
  }
};

// The canonical name and number of a status code, as "NAME (number)".
std::string CodeOf(grpc::StatusCode code) {
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int number = static_cast<int>(code);
  const char* name = number >= 0 && number <= 16 ? kNames[number] : "CODE";
  return std::string(name) + " (" + std::to_string(number) + ")";
}

// The text in double quotes, with what would break the line escaped.
std::string Quote(const std::string& text) {
  std::string quoted = "\"";
  for (char c : text) {
    switch (c) {
      case '"': quoted += "\\\""; break;
      case '\\': quoted += "\\\\"; break;
      case '\n': quoted += "\\n"; break;
      case '\r': quoted += "\\r"; break;
      case '\t': quoted += "\\t"; break;
      default: quoted += c;
    }
  }
  return quoted + "\"";
}

// Prints a call's status code, its ErrorInfo reason and every BadRequest field violation, read
// from the status's error_details: a serialized google.rpc.Status.
void PrintError(const std::string& what, const grpc::Status& status) {
  google::rpc::Status details;
  details.ParseFromString(status.error_details());
  std::string reason;
  google::rpc::BadRequest bad_request;
  for (const google::protobuf::Any& detail : details.details()) {
    google::rpc::ErrorInfo info;
    google::rpc::BadRequest violations;
    if (detail.UnpackTo(&info)) {
      reason = info.reason();
    } else if (detail.UnpackTo(&violations)) {
      bad_request.MergeFrom(violations);
    }
  }
  std::cout << what << ": " << CodeOf(status.error_code()) << " (reason " << reason
            << "): " << status.error_message() << std::endl;
  for (const auto& violation : bad_request.field_violations()) {
    std::cout << "  violation " << violation.field() << ": " << violation.description() << std::endl;
  }
}

class Example {
 public:
  Example(std::shared_ptr<grpc::Channel> channel, Options options)
      : stub_(v1::GenerationService::NewStub(channel)), options_(std::move(options)) {}

  // Starts a long stream and cancels it after its third token; the server frees its batch slot.
  grpc::Status CancelMidway() {
    v1::GenerateStreamRequest request;
    request.set_prompt("The history of the printing press");
    request.mutable_stopping()->set_max_new_tokens(512);
    request.mutable_stopping()->set_ignore_eos(true);
    grpc::ClientContext context;
    Prepare(context);
    auto reader = stub_->GenerateStream(&context, request);
    v1::GenerateStreamResponse response;
    uint32_t received = 0;
    while (received < 3 && reader->Read(&response)) {
      received = response.generated_tokens();
    }
    if (received < 3) return reader->Finish();  // the stream failed before its third token
    context.TryCancel();
    while (reader->Read(&response)) {
      // messages already in flight, then the cancellation
    }
    grpc::Status status = reader->Finish();
    std::cout << "cancel: cancelled after " << received << " tokens: " << CodeOf(status.error_code())
              << std::endl;
    return grpc::Status::OK;
  }

  // Prints each message's tokens the moment it arrives.
  grpc::Status StreamChat() {
    v1::GenerateStreamRequest request;
    v1::ChatMessage* message = request.mutable_chat()->add_messages();
    message->set_role("user");
    message->set_content("Why is the sky blue?");
    request.mutable_sampling()->set_temperature(0);  // greedy: the same answer every run
    request.mutable_stopping()->set_max_new_tokens(options_.max_new_tokens);
    grpc::ClientContext context;
    Prepare(context);
    auto reader = stub_->GenerateStream(&context, request);
    v1::GenerateStreamResponse response;
    while (reader->Read(&response)) {
      if (response.input_tokens() > 0) {
        std::cout << "chat: " << response.input_tokens() << " prompt tokens" << std::endl;
      }
      if (!response.text().empty()) {
        std::cout << "token " << response.generated_tokens() << ": " << Quote(response.text()) << std::endl;
      }
      if (response.has_finish()) {
        std::cout << "finish: " << v1::FinishReason_Name(response.finish().reason()) << " after "
                  << response.finish().usage().completion_tokens() << " tokens" << std::endl;
      }
    }
    return reader->Finish();
  }

  // Asks for two out-of-range samplers; the error says which fields and why.
  bool SendInvalidRequest() {
    v1::GenerateRequest request;
    request.set_prompt("Hello");
    request.mutable_sampling()->set_temperature(-1);
    request.mutable_sampling()->set_top_p(2);
    grpc::ClientContext context;
    Prepare(context);
    v1::GenerateResponse response;
    grpc::Status status = stub_->Generate(&context, request, &response);
    if (status.ok()) return false;
    PrintError("invalid request", status);
    return true;
  }

 private:
  // Each call's deadline, and the API key when there is one.
  void Prepare(grpc::ClientContext& context) const {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::duration_cast<std::chrono::system_clock::duration>(
                             std::chrono::duration<double>(options_.timeout_s)));
    if (!options_.api_key.empty()) context.AddMetadata("authorization", "Bearer " + options_.api_key);
  }

  std::unique_ptr<v1::GenerationService::Stub> stub_;
  Options options_;
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = Options::Parse(argc, argv);
  Example example(grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials()), options);
  grpc::Status status = example.CancelMidway();
  if (status.ok()) status = example.StreamChat();
  if (!status.ok()) {
    PrintError("error", status);
    return 1;
  }
  if (!example.SendInvalidRequest()) {
    std::cout << "error: the invalid request succeeded" << std::endl;
    return 1;
  }
  return 0;
}
