// OpenAI's Node SDK, completions.create (text completions, POST /v1/completions: the prompt as it
// is, no chat template), whole or with stream: true.
// Options: parameters of the call (default: prompt "The lighthouse keeper wrote in his log",
// max_tokens 20, temperature 0, seed 3; stream, stream_options as OpenAI's).
// Prints text (the choice's text, or the chunks' concatenated), object (the response's, or the
// first chunk's), usage and sdk_usage (the response's, or the usage chunk's), finish_reason, and
// when streamed: deltas (chunks with text), events (chunks), usage_chunks and
// usage_chunk_choices (the usage chunk's choices: [] in OpenAI's).

import OpenAI from "openai";
import { main, sdk } from "./common.mjs";

main(async (base, options, seen) => {
  seen.sdk = sdk("openai");
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const r = await client.completions.create({
    model: "any", prompt: "The lighthouse keeper wrote in his log", max_tokens: 20, temperature: 0, seed: 3, ...options,
  });
  if (!options.stream) {
    return {
      object: r.object,
      text: r.choices[0].text,
      usage: { input: r.usage?.prompt_tokens, output: r.usage?.completion_tokens },
      sdk_usage: r.usage,
      finish_reason: r.choices[0].finish_reason,
    };
  }
  Object.assign(seen, { text: "", deltas: 0, events: 0, usage_chunks: 0 });
  for await (const chunk of r) {
    seen.events += 1;
    seen.object ??= chunk.object;
    const choice = chunk.choices[0];
    if (choice?.text) {
      seen.text += choice.text;
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
