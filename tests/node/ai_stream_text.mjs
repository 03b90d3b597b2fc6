// The AI SDK's streamText (package `ai`) through one of its providers, pointed at the server:
// the same reading of fullStream whichever provider it is, so a provider is one entry in
// PROVIDERS. Options: provider (default "openai-compatible"), and parameters of streamText in the
// AI SDK's names (default: MESSAGES, maxOutputTokens 20, temperature 0, maxRetries 0, and the
// provider's defaults: seed 3 where the API has one); tools as JSON: {name: {description,
// input_schema}} (a JSON schema), each made tool({description, inputSchema: jsonSchema(...)}),
// with no execute: the step ends at the calls.
// Prints text and deltas (text-delta parts), events and event_types (fullStream's parts, by
// type), usage and sdk_usage (the finish part's totalUsage), finish_reason (the AI SDK's) and
// raw_finish_reason (the provider's), calls ([{name, input, id}] of the tool-call parts, input as
// the AI SDK parsed it), error (an error part, or what streamText threw), warnings.

import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { jsonSchema, streamText, tool } from "ai";
import { count, errorOf, MESSAGES, main, sdk, usage } from "./common.mjs";

// name: {pkg: the provider's package, model: (server root) => a language model on the server,
// defaults: streamText parameters of its own}
const PROVIDERS = {
  // Chat Completions; includeUsage asks for the usage chunk (stream_options.include_usage)
  "openai-compatible": {
    pkg: "@ai-sdk/openai-compatible",
    model: (base) =>
      createOpenAICompatible({ name: "local", baseURL: `${base}/v1`, apiKey: "unused", includeUsage: true })("any"),
    defaults: { seed: 3 },
  },
  // Messages; this provider's baseURL includes /v1 (its default is https://api.anthropic.com/v1).
  // No seed: Anthropic's API has none (the provider would warn that it dropped it).
  anthropic: {
    pkg: "@ai-sdk/anthropic",
    model: (base) => createAnthropic({ baseURL: `${base}/v1`, apiKey: "unused" })("any"),
    defaults: {},
  },
  // OpenAI's own provider: the Responses API (its default); no seed (Responses has none: the
  // provider would warn that it dropped it)
  openai: {
    pkg: "@ai-sdk/openai",
    model: (base) => createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" })("any"),
    defaults: {},
  },
  // the same provider on Chat Completions (it asks for the usage chunk itself)
  "openai-chat": {
    pkg: "@ai-sdk/openai",
    model: (base) => createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" }).chat("any"),
    defaults: { seed: 3 },
  },
  // and on text completions: the provider writes the messages as one prompt, "user:\n...\n\n
  // assistant:\n", with stop ["\nuser:"]
  "openai-completion": {
    pkg: "@ai-sdk/openai",
    model: (base) => createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" }).completion("any"),
    defaults: { seed: 3 },
  },
};

// {name: {description, input_schema}} as the AI SDK's tools
const toolsOf = (tools) =>
  Object.fromEntries(
    Object.entries(tools).map(([name, t]) => [
      name,
      tool({ description: t.description, inputSchema: jsonSchema(t.input_schema) }),
    ]),
  );

main(async (base, { provider = "openai-compatible", tools, ...options }, seen) => {
  if (!(provider in PROVIDERS)) usage(`unknown provider ${provider}: one of ${Object.keys(PROVIDERS)}`);
  const { pkg, model, defaults } = PROVIDERS[provider];
  Object.assign(seen, { sdk: `${sdk("ai")} ${sdk(pkg)}`, text: "", deltas: 0, events: 0, event_types: {} });
  const result = streamText({
    model: model(base), messages: MESSAGES, maxOutputTokens: 20, temperature: 0, maxRetries: 0,
    abortSignal: AbortSignal.timeout(30_000), ...defaults, ...options, ...(tools && { tools: toolsOf(tools) }),
    onError: () => {}, // errors are read from the stream below, not logged
  });
  for await (const part of result.fullStream) {
    seen.events += 1;
    count(seen.event_types, part.type);
    if (part.type === "text-delta") {
      seen.text += part.text;
      seen.deltas += 1;
    } else if (part.type === "tool-call") {
      (seen.calls ??= []).push({ name: part.toolName, input: part.input, id: part.toolCallId });
    } else if (part.type === "error") {
      seen.error ??= errorOf(part.error);
    } else if (part.type === "finish") {
      seen.finish_reason = part.finishReason;
      seen.raw_finish_reason = part.rawFinishReason;
      seen.sdk_usage = part.totalUsage;
      seen.usage = { input: part.totalUsage.inputTokens, output: part.totalUsage.outputTokens };
    }
  }
});
