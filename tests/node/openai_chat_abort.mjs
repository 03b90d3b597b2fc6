// OpenAI's Node SDK, a streamed chat completion aborted mid-stream with an AbortController (the
// way a web app cancels): after `abort_after` content deltas (default 10), controller.abort().
// Options: abort_after, and parameters of the call (default: MESSAGES, max_tokens 200, seed 3).
// Prints text and deltas (what arrived before the abort), aborted (whether the abort happened),
// after_abort (chunks the loop still got after it: none, the SDK ends the loop quietly), ended_by
// ("loop end", or the name of what the loop threw), error (anything else that went wrong).

import OpenAI from "openai";
import { MESSAGES, main, sdk } from "./common.mjs";

main(async (base, { abort_after = 10, ...options }, seen) => {
  Object.assign(seen, { sdk: sdk("openai"), text: "", deltas: 0, events: 0, after_abort: 0 });
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const controller = new AbortController();
  const stream = await client.chat.completions.create(
    { model: "any", messages: MESSAGES, max_tokens: 200, seed: 3, stream: true, ...options },
    { signal: controller.signal },
  );
  try {
    for await (const chunk of stream) {
      if (controller.signal.aborted) {
        seen.after_abort += 1;
        continue;
      }
      seen.events += 1;
      const content = chunk.choices[0]?.delta?.content;
      if (content) {
        seen.text += content;
        seen.deltas += 1;
        if (seen.deltas === abort_after) controller.abort();
      }
    }
    seen.ended_by = "loop end";
  } catch (e) {
    if (!(e instanceof OpenAI.APIUserAbortError || e.name === "AbortError")) throw e;
    seen.ended_by = e.name;
  }
  seen.aborted = controller.signal.aborted;
});
