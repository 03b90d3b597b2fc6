// Anthropic's Node SDK, client.messages.stream(...) read event by event, then finalMessage().
// Options: parameters of the call (default: MESSAGES, max_tokens 20, temperature 0).
// Prints text and deltas (from the `text` events), events and event_types (the stream's events,
// by type), usage and sdk_usage (the final message's), finish_reason (its stop_reason),
// final_text (the final message's text, which should be the streamed one), stop_sequence, blocks
// (the final message's content block types) and calls ([{name, input, id}] of its tool_use
// blocks: `input` as the SDK accumulated it from the input_json_delta events, which
// input_json_deltas counts).

import Anthropic from "@anthropic-ai/sdk";
import { MESSAGES, count, main, sdk } from "./common.mjs";

main(async (base, options, seen) => {
  Object.assign(seen, { sdk: sdk("@anthropic-ai/sdk"), text: "", deltas: 0, events: 0, event_types: {} });
  const client = new Anthropic({ baseURL: base, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const stream = client.messages.stream({
    model: "any", messages: MESSAGES, max_tokens: 20, temperature: 0, ...options,
  });
  stream.on("text", (delta) => {
    seen.text += delta;
    seen.deltas += 1;
  });
  seen.input_json_deltas = 0;
  for await (const event of stream) {
    seen.events += 1;
    count(seen.event_types, event.type);
    if (event.type === "content_block_delta" && event.delta.type === "input_json_delta") {
      seen.input_json_deltas += 1;
    }
  }
  const final = await stream.finalMessage();
  Object.assign(seen, {
    final_text: final.content.filter((b) => b.type === "text").map((b) => b.text).join(""),
    usage: { input: final.usage.input_tokens, output: final.usage.output_tokens },
    sdk_usage: final.usage,
    finish_reason: final.stop_reason,
    stop_sequence: final.stop_sequence,
    blocks: final.content.map((b) => b.type),
    calls: final.content
      .filter((b) => b.type === "tool_use")
      .map((b) => ({ name: b.name, input: b.input, id: b.id })),
  });
});
