// Streams a chat answer from nanoplane's gRPC API (nanoplane.v1.Generation).
//
//	./generate.sh && go mod tidy && go run . [-addr 127.0.0.1:50051] [question]
//
// Not built or run in CI (there is no Go toolchain there); tests/deploy/test_node_client.py runs the
// Node example against a real server instead.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	pb "nanoplane-example/nanoplanev1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "the server's host:port")
	maxTokens := flag.Uint("max-tokens", 32, "tokens to generate at most")
	flag.Parse()
	question := "What is the capital of France?"
	if flag.NArg() > 0 {
		question = strings.Join(flag.Args(), " ")
	}

	// TLS: grpc.WithTransportCredentials(credentials.NewClientTLSFromFile("ca.pem", "")); bearer tokens:
	// metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token).
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("connect: %v", err)
	}
	defer conn.Close()
	client := pb.NewGenerationClient(conn)

	// Always a deadline: the server drops a request still queued when it passes.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	temperature := float32(0)
	mt := uint32(*maxTokens)
	req := &pb.GenerateRequest{
		// Chat is the conversation without the ChatMessages wrapper of the older Messages field.
		Chat:     []*pb.ChatMessage{{Role: "user", Content: question}},
		Sampling: &pb.SamplingParams{Temperature: &temperature, MaxTokens: &mt},
	}
	stream, err := client.Generate(ctx, req)
	if err != nil {
		fail(err)
	}
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			fail(err)
		}
		fmt.Print(msg.GetText())
		if msg.GetFinishReason() != pb.FinishReason_FINISH_REASON_UNSPECIFIED {
			u := msg.GetUsage()
			fmt.Fprintf(os.Stderr, "\n[%s; %d prompt tokens, %d generated]\n", msg.GetFinishReason(),
				u.GetPromptTokens(), u.GetCompletionTokens())
		}
	}
}

// fail prints the status and its google.rpc details: the field a bad request is wrong in, or how long
// to wait before a retry.
func fail(err error) {
	st := status.Convert(err)
	fmt.Fprintf(os.Stderr, "error %s: %s\n", st.Code(), st.Message())
	for _, d := range st.Details() {
		switch info := d.(type) {
		case *errdetails.BadRequest:
			for _, v := range info.GetFieldViolations() {
				fmt.Fprintf(os.Stderr, "  field %s: %s\n", v.GetField(), v.GetDescription())
			}
		case *errdetails.RetryInfo:
			fmt.Fprintf(os.Stderr, "  retry after %s\n", info.GetRetryDelay().AsDuration())
		}
	}
	os.Exit(1)
}
