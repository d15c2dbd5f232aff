package dev.tokenspout.example;

import com.google.protobuf.Any;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.rpc.BadRequest;
import com.google.rpc.ErrorInfo;
import dev.tokenspout.v1.Chat;
import dev.tokenspout.v1.ChatMessage;
import dev.tokenspout.v1.GenerateRequest;
import dev.tokenspout.v1.GenerateStreamRequest;
import dev.tokenspout.v1.GenerateStreamResponse;
import dev.tokenspout.v1.GenerationServiceGrpc;
import dev.tokenspout.v1.GenerationServiceGrpc.GenerationServiceBlockingStub;
import dev.tokenspout.v1.SamplingParams;
import dev.tokenspout.v1.StoppingCriteria;
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
 * streams a chat token by token, and reads the google.rpc details of an invalid request. Every
 * call carries a deadline and, when one is given, an API key.
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
      example.cancelMidway();
      example.streamChat(options.maxNewTokens());
      example.sendInvalidRequest();
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

  /** Command-line flags: --address, --api-key, --timeout (seconds), --max-new-tokens. */
  private record Options(String address, String apiKey, long timeoutMs, int maxNewTokens) {
    static Options parse(String[] args) {
      String address = System.getenv().getOrDefault("TOKENSPOUT_ADDRESS", "127.0.0.1:50051");
      String apiKey = System.getenv().getOrDefault("TOKENSPOUT_API_KEY", "");
      double timeoutS = 60;
      int maxNewTokens = 64;
      for (int i = 0; i + 1 < args.length; i += 2) {
        switch (args[i]) {
          case "--address" -> address = args[i + 1];
          case "--api-key" -> apiKey = args[i + 1];
          case "--timeout" -> timeoutS = Double.parseDouble(args[i + 1]);
          case "--max-new-tokens" -> maxNewTokens = Integer.parseInt(args[i + 1]);
          default -> throw new IllegalArgumentException("unknown flag " + args[i]);
        }
      }
      return new Options(address, apiKey, Math.round(timeoutS * 1000), maxNewTokens);
    }
  }
}
