// Streams a chat answer from nanoplane's gRPC API, loading the .proto at run time (no codegen step).
//
//   npm ci
//   node generate.js [address] [question]      # defaults: 127.0.0.1:50051, "What is the capital of France?"
//
// PROTO_PATH (env) points elsewhere when this folder is copied out of the repository.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_PATH = process.env.PROTO_PATH
  || path.join(__dirname, "..", "..", "..", "proto", "nanoplane", "v1", "generation.proto");

// The options people trip on; proto-loader's defaults differ from what the .proto and its docs say.
const definition = protoLoader.loadSync(PROTO_PATH, {
  // Field names as written in the .proto (token_ids, finish_reason, max_tokens). Without it they are
  // camelCased (tokenIds), and a request written with snake_case names loses those fields silently.
  keepCase: true,
  // Enums as their names ("FINISH_REASON_STOP"); the default is the number (1).
  enums: String,
  // 64-bit integers as strings: JavaScript numbers lose precision past 2^53 (seed is a uint64).
  longs: String,
  // Unset fields come with their default (0, "", []): proto3 sends no zero values, so without this
  // the first sample's `index` (0) and an empty `text` are simply missing from a message.
  defaults: true,
  // A virtual field naming which member of each oneof is set (e.g. prompt: "chat" is not a oneof
  // member, but stop_reason on the last message is).
  oneofs: true,
});
const { Generation } = grpc.loadPackageDefinition(definition).nanoplane.v1;

function main() {
  const address = process.argv[2] || "127.0.0.1:50051";
  const question = process.argv[3] || "What is the capital of France?";
  // TLS: grpc.credentials.createSsl(fs.readFileSync("ca.pem")); bearer tokens: a Metadata with
  // authorization: "Bearer ..." as the second argument of generate().
  const client = new Generation(address, grpc.credentials.createInsecure());
  const request = {
    // `chat` is the conversation without the ChatMessages wrapper (the older `messages` field needs
    // {messages: {messages: [...]}}).
    chat: [{ role: "user", content: question }],
    sampling: { temperature: 0, max_tokens: 32 },
  };
  const deadline = new Date(Date.now() + 60_000); // always set one: a hung call otherwise waits forever
  const call = client.generate(request, { deadline });
  call.on("data", (msg) => {
    process.stdout.write(msg.text);
    if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      const u = msg.usage;
      process.stderr.write(`\n[${msg.finish_reason}; ${u.prompt_tokens} prompt tokens, `
        + `${u.completion_tokens} generated]\n`);
    }
  });
  call.on("error", (err) => {
    // err.code is a grpc.status number (3: INVALID_ARGUMENT), err.details the server's message; the
    // google.rpc.Status with its BadRequest/RetryInfo details is err.metadata.get("grpc-status-details-bin").
    process.stderr.write(`error ${grpc.status[err.code]}: ${err.details}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on("end", () => client.close());
}

main();
