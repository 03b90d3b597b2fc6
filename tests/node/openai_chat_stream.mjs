// OpenAI's Node SDK, chat.completions.create({stream: true}) with stream_options.include_usage.
// Options: parameters of the call (default: MESSAGES, max_tokens 20, temperature 0, seed 3,
// include_usage). Prints text, deltas (chunks with content), events (chunks), usage and
// sdk_usage (from the usage chunk), finish_reason, and what the chunks looked like: role (the
// first chunk's), usage_chunks (how many carried usage), usage_chunk_choices (the usage chunk's
// choices: [] in OpenAI's), chunk_object.

import OpenAI from "openai";
import { MESSAGES, main, sdk } from "./common.mjs";

main(async (base, options, seen) => {
  Object.assign(seen, { sdk: sdk("openai"), text: "", deltas: 0, events: 0, usage_chunks: 0 });
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const stream = await client.chat.completions.create({
    model: "any", messages: MESSAGES, max_tokens: 20, temperature: 0, seed: 3,
    stream: true, stream_options: { include_usage: true }, ...options,
  });
  for await (const chunk of stream) {
    seen.events += 1;
    seen.chunk_object ??= chunk.object;
    const choice = chunk.choices[0];
    if (choice?.delta?.role) seen.role ??= choice.delta.role;
    if (choice?.delta?.content) {
      seen.text += choice.delta.content;
      seen.deltas += 1;
    }
    if (choice?.finish_reason) seen.finish_reason = choice.finish_reason;
    if (chunk.usage) {
      seen.usage_chunks += 1;
      seen.usage_chunk_choices = chunk.choices;
      seen.sdk_usage = chunk.usage;
      seen.usage = { input: chunk.usage.prompt_tokens, output: chunk.usage.completion_tokens };
    }
  }
});
