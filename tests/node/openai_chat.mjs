// OpenAI's Node SDK, chat.completions.create without streaming: the whole answer.
// Options: parameters of the call (default: MESSAGES, max_tokens 20, temperature 0, seed 3).
// Prints text, usage, sdk_usage, finish_reason, object, id.

import OpenAI from "openai";
import { MESSAGES, main, sdk } from "./common.mjs";

main(async (base, options, seen) => {
  seen.sdk = sdk("openai");
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const r = await client.chat.completions.create({
    model: "any", messages: MESSAGES, max_tokens: 20, temperature: 0, seed: 3, ...options,
  });
  return {
    object: r.object,
    id: r.id,
    text: r.choices[0].message.content,
    usage: { input: r.usage?.prompt_tokens, output: r.usage?.completion_tokens },
    sdk_usage: r.usage,
    finish_reason: r.choices[0].finish_reason,
  };
});
