package dev.tokenspout.example;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.BadRequest;
import com.google.rpc.ErrorInfo;
import dev.tokenspout.v1.Chat;
import dev.tokenspout.v1.ChatMessage;
import dev.tokenspout.v1.Finish;
import dev.tokenspout.v1.GenerateRequest;
import dev.tokenspout.v1.GenerateResponse;
import dev.tokenspout.v1.GenerateStreamRequest;
import dev.tokenspout.v1.GenerateStreamResponse;
import dev.tokenspout.v1.GenerationServiceGrpc;
import dev.tokenspout.v1.GenerationServiceGrpc.GenerationServiceBlockingStub;
import dev.tokenspout.v1.SamplingParams;
import dev.tokenspout.v1.StoppingCriteria;
import dev.tokenspout.v1.Tool;
import dev.tokenspout.v1.ToolCall;
import dev.tokenspout.v1.ToolCallDelta;
import dev.tokenspout.v1.ToolChoice;
import dev.tokenspout.v1.ToolChoiceMode;
import io.grpc.Context;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.protobuf.StatusProto;
import io.grpc.stub.MetadataUtils;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * Calls a tokenspout server through the stubs generated from protos/: cancels a stream mid-way,
 * streams a chat token by token, and reads the google.rpc details of an invalid request; with
 * --tools it does a tool call round trip instead. Every call carries a deadline and, when one is
 * given, an API key.
 */
public final class TokenspoutExample {
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  private final GenerationServiceBlockingStub stub;
  private final long timeoutMs;

  private TokenspoutExample(GenerationServiceBlockingStub stub, long timeoutMs) {
    this.stub = stub;
    this.timeoutMs = timeoutMs;
  }

  public static void main(String[] args) throws InterruptedException {
    Options options = Options.parse(args);
    ManagedChannel channel = ManagedChannelBuilder.forTarget(options.address()).usePlaintext().build();
    GenerationServiceBlockingStub stub = GenerationServiceGrpc.newBlockingStub(channel);
    if (!options.apiKey().isEmpty()) {
      Metadata headers = new Metadata();
      headers.put(AUTHORIZATION, "Bearer " + options.apiKey());
      stub = stub.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    int exitCode = 0;
    try {
      TokenspoutExample example = new TokenspoutExample(stub, options.timeoutMs());
      if (options.tools()) {
        example.toolRoundTrip(options.maxNewTokens());
      } else {
        example.cancelMidway();
        example.streamChat(options.maxNewTokens());
        example.sendInvalidRequest();
      }
    } catch (StatusRuntimeException error) {
      printError("error", error);
      exitCode = 1;
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
    System.exit(exitCode);
  }

  /** A stub whose deadline starts now: deadlines are absolute, so each call takes a fresh one. */
  private GenerationServiceBlockingStub withDeadline() {
    return stub.withDeadlineAfter(timeoutMs, TimeUnit.MILLISECONDS);
  }

  /** Starts a long stream and cancels it after its third token; the server frees its batch slot. */
  private void cancelMidway() {
    GenerateStreamRequest request =
        GenerateStreamRequest.newBuilder()
            .setPrompt("The history of the printing press")
            .setStopping(StoppingCriteria.newBuilder().setMaxNewTokens(512).setIgnoreEos(true))
            .build();
    // A blocking stream is cancelled through the gRPC Context it was started in.
    try (Context.CancellableContext call = Context.current().withCancellation()) {
      call.run(() -> {
        Iterator<GenerateStreamResponse> responses = withDeadline().generateStream(request);
        int received = 0;
        while (received < 3) {
          received = responses.next().getGeneratedTokens();
        }
        call.cancel(null);
        Status.Code code = Status.Code.OK;
        try {
          while (responses.hasNext()) {
            responses.next(); // messages already in flight, then the cancellation
          }
        } catch (StatusRuntimeException error) {
          code = error.getStatus().getCode();
        }
        System.out.printf("cancel: cancelled after %d tokens: %s%n", received, nameOf(code));
      });
    }
  }

  /** Prints each message's tokens the moment it arrives. */
  private void streamChat(int maxNewTokens) {
    GenerateStreamRequest request =
        GenerateStreamRequest.newBuilder()
            .setChat(Chat.newBuilder().addMessages(
                ChatMessage.newBuilder().setRole("user").setContent("Why is the sky blue?")))
            .setSampling(SamplingParams.newBuilder().setTemperature(0)) // greedy: the same answer every run
            .setStopping(StoppingCriteria.newBuilder().setMaxNewTokens(maxNewTokens))
            .build();
    Iterator<GenerateStreamResponse> responses = withDeadline().generateStream(request);
    while (responses.hasNext()) {
      GenerateStreamResponse response = responses.next();
      if (response.getInputTokens() > 0) {
        System.out.printf("chat: %d prompt tokens%n", response.getInputTokens());
      }
      if (!response.getText().isEmpty()) {
        System.out.printf("token %d: %s%n", response.getGeneratedTokens(), quote(response.getText()));
      }
      if (response.hasFinish()) {
        System.out.printf("finish: %s after %d tokens%n", response.getFinish().getReason(),
            response.getFinish().getUsage().getCompletionTokens());
      }
    }
  }

  /** The one tool the round trip offers: its parameters are a JSON Schema, as text. */
  private static final Tool WEATHER =
      Tool.newBuilder()
          .setName("get_weather")
          .setDescription("The current weather in a city.")
          .setParameters("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
              + "\"required\":[\"city\"]}")
          .build();

  /**
   * Makes the model call get_weather (tool choice required: the grammar forces a well-formed call),
   * assembles the call from the streamed deltas, then sends the call and its result back with tool
   * choice none, so the model answers in text.
   */
  private void toolRoundTrip(int maxNewTokens) {
    ChatMessage ask = ChatMessage.newBuilder()
        .setRole("user").setContent("What is the weather in Paris? Answer in one sentence.").build();
    GenerateStreamRequest request =
        GenerateStreamRequest.newBuilder()
            .setChat(Chat.newBuilder()
                .addMessages(ask)
                .addTools(WEATHER)
                .setToolChoice(ToolChoice.newBuilder().setMode(ToolChoiceMode.TOOL_CHOICE_MODE_REQUIRED))
                .setParallelToolCalls(false)) // one call
            .setSampling(SamplingParams.newBuilder().setTemperature(0)) // the same call every run
            .setStopping(StoppingCriteria.newBuilder().setMaxNewTokens(64))
            .build();
    List<ToolCall.Builder> streamed = new ArrayList<>();
    List<ToolCall> calls = new ArrayList<>();
    Finish finish = Finish.getDefaultInstance();
    Iterator<GenerateStreamResponse> responses = withDeadline().generateStream(request);
    while (responses.hasNext()) {
      GenerateStreamResponse response = responses.next();
      // A call's first delta carries its id and name, the later ones the next characters of its
      // arguments: joined by index, they are the call.
      for (ToolCallDelta delta : response.getToolCallDeltasList()) {
        while (streamed.size() <= delta.getIndex()) {
          streamed.add(ToolCall.newBuilder());
        }
        ToolCall.Builder call = streamed.get(delta.getIndex());
        if (!delta.getId().isEmpty()) {
          call.setId(delta.getId()).setName(delta.getName());
        }
        call.setArguments(call.getArguments() + delta.getArgumentsDelta());
      }
      calls.addAll(response.getToolCallsList()); // each call whole, once complete
      if (response.hasFinish()) {
        finish = response.getFinish();
      }
    }
    printCalls("tool streamed", streamed.stream().map(ToolCall.Builder::build).toList());
    printCalls("tool call", calls);
    System.out.printf("tool finish: %s%n", finish.getReason());

    // The history sent back: the question, the assistant's calls, and one tool message per call
    // naming the call it answers.
    Chat.Builder history = Chat.newBuilder()
        .addMessages(ask)
        .addMessages(ChatMessage.newBuilder().setRole("assistant").addAllToolCalls(calls))
        .addTools(WEATHER)
        .setToolChoice(ToolChoice.newBuilder().setMode(ToolChoiceMode.TOOL_CHOICE_MODE_NONE));
    for (ToolCall call : calls) {
      history.addMessages(ChatMessage.newBuilder()
          .setRole("tool").setToolCallId(call.getId()).setContent("{\"sky\":\"clear\",\"celsius\":21}"));
    }
    GenerateResponse answer = withDeadline().generate(
        GenerateRequest.newBuilder()
            .setChat(history)
            .setSampling(SamplingParams.newBuilder().setTemperature(0))
            .setStopping(StoppingCriteria.newBuilder().setMaxNewTokens(maxNewTokens))
            .build());
    System.out.printf("answer: %s%n", quote(answer.getText()));
    System.out.printf("answer finish: %s, %d tool calls%n", answer.getFinish().getReason(),
        answer.getToolCallsCount());
  }

  /** Prints one line per call: "WHAT: ID NAME ARGUMENTS". */
  private static void printCalls(String what, List<ToolCall> calls) {
    for (ToolCall call : calls) {
      System.out.printf("%s: %s %s %s%n", what, call.getId(), call.getName(), call.getArguments());
    }
  }

  /** Asks for two out-of-range samplers; the error says which fields and why. */
  private void sendInvalidRequest() {
    GenerateRequest request =
        GenerateRequest.newBuilder()
            .setPrompt("Hello")
            .setSampling(SamplingParams.newBuilder().setTemperature(-1).setTopP(2))
            .build();
    try {
      withDeadline().generate(request);
    } catch (StatusRuntimeException error) {
      printError("invalid request", error);
      return;
    }
    throw new IllegalStateException("the invalid request succeeded");
  }

  /** Prints a call's status code, its ErrorInfo reason and every BadRequest field violation. */
  private static void printError(String what, StatusRuntimeException error) {
    com.google.rpc.Status status = StatusProto.fromThrowable(error);
    String reason = "";
    List<BadRequest.FieldViolation> violations = new ArrayList<>();
    for (Any detail : status == null ? List.<Any>of() : status.getDetailsList()) {
      try {
        if (detail.is(ErrorInfo.class)) {
          reason = detail.unpack(ErrorInfo.class).getReason();
        } else if (detail.is(BadRequest.class)) {
          violations.addAll(detail.unpack(BadRequest.class).getFieldViolationsList());
        }
      } catch (InvalidProtocolBufferException malformed) {
        throw new IllegalStateException(malformed);
      }
    }
    System.out.printf("%s: %s (reason %s): %s%n", what, nameOf(error.getStatus().getCode()), reason,
        error.getStatus().getDescription());
    for (BadRequest.FieldViolation violation : violations) {
      System.out.printf("  violation %s: %s%n", violation.getField(), violation.getDescription());
    }
  }

  /** Names a status code as "NAME (number)". */
  private static String nameOf(Status.Code code) {
    return code + " (" + code.value() + ")";
  }

  /** The text in double quotes, with what would break the line escaped. */
  private static String quote(String text) {
    return '"' + text.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n").replace("\r", "\\r")
        .replace("\t", "\\t") + '"';
  }

  /** Command-line flags: --address, --api-key, --timeout (seconds), --max-new-tokens, --tools. */
  private record Options(String address, String apiKey, long timeoutMs, int maxNewTokens, boolean tools) {
    static Options parse(String[] args) {
      String address = System.getenv().getOrDefault("TOKENSPOUT_ADDRESS", "127.0.0.1:50051");
      String apiKey = System.getenv().getOrDefault("TOKENSPOUT_API_KEY", "");
      double timeoutS = 60;
      int maxNewTokens = 64;
      boolean tools = false;
      for (int i = 0; i < args.length; i++) {
        String flag = args[i];
        if (flag.equals("--tools")) { // the one flag without a value
          tools = true;
          continue;
        }
        if (i + 1 == args.length) {
          throw new IllegalArgumentException("flag " + flag + " needs a value");
        }
        String value = args[++i];
        switch (flag) {
          case "--address" -> address = value;
          case "--api-key" -> apiKey = value;
          case "--timeout" -> timeoutS = Double.parseDouble(value);
          case "--max-new-tokens" -> maxNewTokens = Integer.parseInt(value);
          default -> throw new IllegalArgumentException("unknown flag " + flag);
        }
      }
      return new Options(address, apiKey, Math.round(timeoutS * 1000), maxNewTokens, tools);
    }
  }
}
