// Command tokenspout-example calls a tokenspout server through the stubs generated from protos/:
// it cancels a stream mid-way, streams a chat token by token, and reads the google.rpc details
// of an invalid request; with --tools it does a tool call round trip instead. Every call carries a
// deadline and, when one is given, an API key.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	tokenspoutv1 "github.com/tokenspout/tokenspout/gen/go/tokenspout/v1"
)

// bearer sends `authorization: Bearer <key>` with every call on the connection.
type bearer string

func (key bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(key)}, nil
}

// RequireTransportSecurity is false so the example runs on plaintext loopback; use TLS elsewhere.
func (bearer) RequireTransportSecurity() bool { return false }

func main() {
	address := flag.String("address", envOr("TOKENSPOUT_ADDRESS", "127.0.0.1:50051"), "server host:port")
	apiKey := flag.String("api-key", os.Getenv("TOKENSPOUT_API_KEY"), "API key; empty sends none")
	timeoutS := flag.Float64("timeout", 60, "deadline of each call, in seconds")
	maxNewTokens := flag.Uint("max-new-tokens", 64, "most tokens the chat may generate")
	tools := flag.Bool("tools", false, "do a tool call round trip instead")
	flag.Parse()
	timeout := time.Duration(*timeoutS * float64(time.Second))

	options := []grpc.DialOption{grpc.WithInsecure()}
	if *apiKey != "" {
		options = append(options, grpc.WithPerRPCCredentials(bearer(*apiKey)))
	}
	conn, err := grpc.Dial(*address, options...)
	if err != nil {
		fail(err)
	}
	defer conn.Close()
	client := tokenspoutv1.NewGenerationServiceClient(conn)

	if *tools {
		if err := toolRoundTrip(client, timeout, uint32(*maxNewTokens)); err != nil {
			fail(err)
		}
		return
	}
	if err := cancelMidway(client, timeout); err != nil {
		fail(err)
	}
	if err := streamChat(client, timeout, uint32(*maxNewTokens)); err != nil {
		fail(err)
	}
	sendInvalidRequest(client, timeout)
}

// cancelMidway starts a long stream and cancels it after its third token: the server stops
// generating for it and frees its batch slot.
func cancelMidway(client tokenspoutv1.GenerationServiceClient, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	maxNewTokens := uint32(512)
	stream, err := client.GenerateStream(ctx, &tokenspoutv1.GenerateStreamRequest{
		Input:    &tokenspoutv1.GenerateStreamRequest_Prompt{Prompt: "The history of the printing press"},
		Stopping: &tokenspoutv1.StoppingCriteria{MaxNewTokens: &maxNewTokens, IgnoreEos: true},
	})
	if err != nil {
		return err
	}
	received := uint32(0)
	for received < 3 {
		response, err := stream.Recv()
		if err != nil {
			return err
		}
		received = response.GetGeneratedTokens()
	}
	cancel()
	for err == nil {
		_, err = stream.Recv() // messages already in flight, then the cancellation
	}
	fmt.Printf("cancel: cancelled after %d tokens: %s\n", received, codeOf(err))
	return nil
}

// streamChat prints each message's tokens the moment it arrives.
func streamChat(client tokenspoutv1.GenerationServiceClient, timeout time.Duration, maxNewTokens uint32) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	temperature := float32(0) // greedy: the same answer every run
	stream, err := client.GenerateStream(ctx, &tokenspoutv1.GenerateStreamRequest{
		Input: &tokenspoutv1.GenerateStreamRequest_Chat{Chat: &tokenspoutv1.Chat{
			Messages: []*tokenspoutv1.ChatMessage{{Role: "user", Content: "Why is the sky blue?"}},
		}},
		Sampling: &tokenspoutv1.SamplingParams{Temperature: &temperature},
		Stopping: &tokenspoutv1.StoppingCriteria{MaxNewTokens: &maxNewTokens},
	})
	if err != nil {
		return err
	}
	for {
		response, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if response.GetInputTokens() > 0 {
			fmt.Printf("chat: %d prompt tokens\n", response.GetInputTokens())
		}
		if response.GetText() != "" {
			fmt.Printf("token %d: %q\n", response.GetGeneratedTokens(), response.GetText())
		}
		if finish := response.GetFinish(); finish != nil {
			fmt.Printf("finish: %s after %d tokens\n", finish.GetReason(), finish.GetUsage().GetCompletionTokens())
		}
	}
}

// weather is the one tool the round trip offers: its parameters are a JSON Schema, as text.
var weather = &tokenspoutv1.Tool{
	Name:        "get_weather",
	Description: "The current weather in a city.",
	Parameters:  `{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}`,
}

// toolRoundTrip makes the model call get_weather (tool choice required: the grammar forces a
// well-formed call), assembles the call from the streamed deltas, then sends the call and its
// result back with tool choice none, so the model answers in text.
func toolRoundTrip(client tokenspoutv1.GenerationServiceClient, timeout time.Duration, maxNewTokens uint32) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ask := &tokenspoutv1.ChatMessage{Role: "user", Content: "What is the weather in Paris? Answer in one sentence."}
	temperature, callTokens, parallel := float32(0), uint32(64), false // one call, the same every run
	stream, err := client.GenerateStream(ctx, &tokenspoutv1.GenerateStreamRequest{
		Input: &tokenspoutv1.GenerateStreamRequest_Chat{Chat: &tokenspoutv1.Chat{
			Messages: []*tokenspoutv1.ChatMessage{ask},
			Tools:    []*tokenspoutv1.Tool{weather},
			ToolChoice: &tokenspoutv1.ToolChoice{Choice: &tokenspoutv1.ToolChoice_Mode{
				Mode: tokenspoutv1.ToolChoiceMode_TOOL_CHOICE_MODE_REQUIRED}},
			ParallelToolCalls: &parallel,
		}},
		Sampling: &tokenspoutv1.SamplingParams{Temperature: &temperature},
		Stopping: &tokenspoutv1.StoppingCriteria{MaxNewTokens: &callTokens},
	})
	if err != nil {
		return err
	}
	var streamed, calls []*tokenspoutv1.ToolCall
	var finish *tokenspoutv1.Finish
	for {
		response, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		// A call's first delta carries its id and name, the later ones the next characters of
		// its arguments: joined by index, they are the call.
		for _, delta := range response.GetToolCallDeltas() {
			for len(streamed) <= int(delta.GetIndex()) {
				streamed = append(streamed, &tokenspoutv1.ToolCall{})
			}
			call := streamed[delta.GetIndex()]
			if delta.GetId() != "" {
				call.Id, call.Name = delta.GetId(), delta.GetName()
			}
			call.Arguments += delta.GetArgumentsDelta()
		}
		calls = append(calls, response.GetToolCalls()...) // each call whole, once complete
		if response.GetFinish() != nil {
			finish = response.GetFinish()
		}
	}
	printCalls("tool streamed", streamed)
	printCalls("tool call", calls)
	fmt.Printf("tool finish: %s\n", finish.GetReason())

	// The history sent back: the question, the assistant's calls, and one tool message per call
	// naming the call it answers.
	history := []*tokenspoutv1.ChatMessage{ask, {Role: "assistant", ToolCalls: calls}}
	for _, call := range calls {
		history = append(history, &tokenspoutv1.ChatMessage{
			Role: "tool", ToolCallId: call.GetId(), Content: `{"sky":"clear","celsius":21}`})
	}
	answer, err := client.Generate(ctx, &tokenspoutv1.GenerateRequest{
		Input: &tokenspoutv1.GenerateRequest_Chat{Chat: &tokenspoutv1.Chat{
			Messages: history,
			Tools:    []*tokenspoutv1.Tool{weather},
			ToolChoice: &tokenspoutv1.ToolChoice{Choice: &tokenspoutv1.ToolChoice_Mode{
				Mode: tokenspoutv1.ToolChoiceMode_TOOL_CHOICE_MODE_NONE}},
		}},
		Sampling: &tokenspoutv1.SamplingParams{Temperature: &temperature},
		Stopping: &tokenspoutv1.StoppingCriteria{MaxNewTokens: &maxNewTokens},
	})
	if err != nil {
		return err
	}
	fmt.Printf("answer: %q\n", answer.GetText())
	fmt.Printf("answer finish: %s, %d tool calls\n", answer.GetFinish().GetReason(), len(answer.GetToolCalls()))
	return nil
}

// printCalls prints one line per call: "<what>: <id> <name> <arguments>".
func printCalls(what string, calls []*tokenspoutv1.ToolCall) {
	for _, call := range calls {
		fmt.Printf("%s: %s %s %s\n", what, call.GetId(), call.GetName(), call.GetArguments())
	}
}

// sendInvalidRequest asks for two out-of-range samplers; the error says which fields and why.
func sendInvalidRequest(client tokenspoutv1.GenerationServiceClient, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	temperature, topP := float32(-1), float32(2)
	_, err := client.Generate(ctx, &tokenspoutv1.GenerateRequest{
		Input:    &tokenspoutv1.GenerateRequest_Prompt{Prompt: "Hello"},
		Sampling: &tokenspoutv1.SamplingParams{Temperature: &temperature, TopP: &topP},
	})
	if err == nil {
		fail(errors.New("the invalid request succeeded"))
	}
	printError("invalid request", err)
}

// printError prints a call's status code, its ErrorInfo reason and every BadRequest field violation.
func printError(what string, err error) {
	st, _ := status.FromError(err)
	reason := ""
	var violations []*errdetails.BadRequest_FieldViolation
	for _, detail := range st.Details() {
		switch detail := detail.(type) {
		case *errdetails.ErrorInfo:
			reason = detail.GetReason()
		case *errdetails.BadRequest:
			violations = append(violations, detail.GetFieldViolations()...)
		}
	}
	fmt.Printf("%s: %s (reason %s): %s\n", what, codeOf(err), reason, st.Message())
	for _, violation := range violations {
		fmt.Printf("  violation %s: %s\n", violation.GetField(), violation.GetDescription())
	}
}

// codeOf names a call's status code as "Name (number)".
func codeOf(err error) string {
	code := status.Code(err)
	return fmt.Sprintf("%s (%d)", code, code)
}

func fail(err error) {
	printError("error", err)
	os.Exit(1)
}

func envOr(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}
