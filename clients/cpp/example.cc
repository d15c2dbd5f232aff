// Calls a tokenspout server through the stubs generated from protos/: cancels a stream mid-way,
// streams a chat token by token, and reads the google.rpc details of an invalid request; with
// --tools it does a tool call round trip instead. Every call carries a deadline and, when one is
// given, an API key.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "tokenspout/v1/generation.grpc.pb.h"

namespace {

namespace v1 = tokenspout::v1;

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// Command-line flags: --address, --api-key, --timeout (seconds), --max-new-tokens, --tools.
struct Options {
  std::string address = EnvOr("TOKENSPOUT_ADDRESS", "127.0.0.1:50051");
  std::string api_key = EnvOr("TOKENSPOUT_API_KEY", "");
  double timeout_s = 60;
  uint32_t max_new_tokens = 64;
  bool tools = false;

  static Options Parse(int argc, char** argv) {
    Options options;
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--tools") {  // the one flag without a value
        options.tools = true;
        continue;
      }
      if (i + 1 == argc) throw std::invalid_argument("flag " + flag + " needs a value");
      const std::string value = argv[++i];
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

// The one tool the round trip offers: its parameters are a JSON Schema, as text.
v1::Tool Weather() {
  v1::Tool tool;
  tool.set_name("get_weather");
  tool.set_description("The current weather in a city.");
  tool.set_parameters(R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
  return tool;
}

// Prints one line per call: "WHAT: ID NAME ARGUMENTS".
void PrintCalls(const std::string& what, const std::vector<v1::ToolCall>& calls) {
  for (const v1::ToolCall& call : calls) {
    std::cout << what << ": " << call.id() << " " << call.name() << " " << call.arguments() << std::endl;
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

  // Makes the model call get_weather (tool choice required: the grammar forces a well-formed
  // call), assembles the call from the streamed deltas, then sends the call and its result back
  // with tool choice none, so the model answers in text.
  grpc::Status ToolRoundTrip() {
    v1::GenerateStreamRequest request;
    v1::Chat* chat = request.mutable_chat();
    v1::ChatMessage ask;
    ask.set_role("user");
    ask.set_content("What is the weather in Paris? Answer in one sentence.");
    *chat->add_messages() = ask;
    *chat->add_tools() = Weather();
    chat->mutable_tool_choice()->set_mode(v1::TOOL_CHOICE_MODE_REQUIRED);
    chat->set_parallel_tool_calls(false);             // one call
    request.mutable_sampling()->set_temperature(0);  // the same call every run
    request.mutable_stopping()->set_max_new_tokens(64);
    std::vector<v1::ToolCall> streamed, calls;
    v1::Finish finish;
    {
      grpc::ClientContext context;
      Prepare(context);
      auto reader = stub_->GenerateStream(&context, request);
      v1::GenerateStreamResponse response;
      while (reader->Read(&response)) {
        // A call's first delta carries its id and name, the later ones the next characters of
        // its arguments: joined by index, they are the call.
        for (const v1::ToolCallDelta& delta : response.tool_call_deltas()) {
          if (streamed.size() <= delta.index()) streamed.resize(delta.index() + 1);
          v1::ToolCall& call = streamed[delta.index()];
          if (!delta.id().empty()) {
            call.set_id(delta.id());
            call.set_name(delta.name());
          }
          *call.mutable_arguments() += delta.arguments_delta();
        }
        // Each call whole, once complete.
        calls.insert(calls.end(), response.tool_calls().begin(), response.tool_calls().end());
        if (response.has_finish()) finish = response.finish();
      }
      grpc::Status status = reader->Finish();
      if (!status.ok()) return status;
    }
    PrintCalls("tool streamed", streamed);
    PrintCalls("tool call", calls);
    std::cout << "tool finish: " << v1::FinishReason_Name(finish.reason()) << std::endl;

    // The history sent back: the question, the assistant's calls, and one tool message per call
    // naming the call it answers.
    v1::GenerateRequest second;
    v1::Chat* history = second.mutable_chat();
    *history->add_messages() = ask;
    v1::ChatMessage* assistant = history->add_messages();
    assistant->set_role("assistant");
    for (const v1::ToolCall& call : calls) *assistant->add_tool_calls() = call;
    for (const v1::ToolCall& call : calls) {
      v1::ChatMessage* result = history->add_messages();
      result->set_role("tool");
      result->set_tool_call_id(call.id());
      result->set_content(R"({"sky":"clear","celsius":21})");
    }
    *history->add_tools() = Weather();
    history->mutable_tool_choice()->set_mode(v1::TOOL_CHOICE_MODE_NONE);
    second.mutable_sampling()->set_temperature(0);
    second.mutable_stopping()->set_max_new_tokens(options_.max_new_tokens);
    grpc::ClientContext context;
    Prepare(context);
    v1::GenerateResponse answer;
    grpc::Status status = stub_->Generate(&context, second, &answer);
    if (!status.ok()) return status;
    std::cout << "answer: " << Quote(answer.text()) << std::endl;
    std::cout << "answer finish: " << v1::FinishReason_Name(answer.finish().reason()) << ", "
              << answer.tool_calls_size() << " tool calls" << std::endl;
    return grpc::Status::OK;
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
  if (options.tools) {
    grpc::Status status = example.ToolRoundTrip();
    if (!status.ok()) PrintError("error", status);
    return status.ok() ? 0 : 1;
  }
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
