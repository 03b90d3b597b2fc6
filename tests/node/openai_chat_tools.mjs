// OpenAI's Node SDK accumulating a streamed chat completion with tools: by default
// client.chat.completions.stream(...) and its finalChatCompletion(); with run_tools,
// client.chat.completions.runTools({stream: true, ...}), each tool a local function that returns
// run_tools (a string) as its result, round after round until an answer calls none.
// Options: run_tools, and parameters of the call (default: MESSAGES, max_tokens 80, temperature
// 0, seed 3, stream_options.include_usage; tools in OpenAI's shape, each {type: "function",
// function: {name, description, parameters}}).
// Prints text and deltas (the helper's content.delta events, every round's), events (chunks),
// event_types (the helper's events of these kinds: content.delta, content.done,
// tool_calls.function.arguments.delta, tool_calls.function.arguments.done), finish_reason,
// final_text and calls ([{name, input, id}] of finalChatCompletion()'s message: input parsed
// from the accumulated arguments), usage (the last round's); with run_tools: rounds (chat
// completions made), roles (the conversation's messages' roles at the end), ran ([{name, input}]
// the local functions were called with), final_content (finalContent()).

import OpenAI from "openai";
import { MESSAGES, count, main, sdk } from "./common.mjs";

const KINDS = [
  "content.delta", "content.done", "tool_calls.function.arguments.delta", "tool_calls.function.arguments.done",
];

main(async (base, { run_tools, ...options }, seen) => {
  Object.assign(seen, { sdk: sdk("openai"), text: "", deltas: 0, events: 0, event_types: {} });
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  const params = {
    model: "any", messages: MESSAGES, max_tokens: 80, temperature: 0, seed: 3,
    stream_options: { include_usage: true }, ...options,
  };
  let stream;
  if (run_tools === undefined) {
    stream = client.chat.completions.stream(params);
  } else {
    seen.ran = [];
    const local = (name) => (input) => {
      seen.ran.push({ name, input });
      return run_tools;
    };
    const tools = (params.tools ?? []).map(({ function: f }) => ({
      type: "function",
      function: { ...f, function: local(f.name), parse: JSON.parse },
    }));
    stream = client.chat.completions.runTools({ ...params, tools, stream: true });
  }
  stream.on("chunk", () => (seen.events += 1));
  stream.on("content.delta", ({ delta }) => {
    seen.text += delta;
    seen.deltas += 1;
  });
  for (const kind of KINDS) stream.on(kind, () => count(seen.event_types, kind));
  const final = await stream.finalChatCompletion();
  const choice = final.choices[0];
  Object.assign(seen, {
    finish_reason: choice.finish_reason,
    final_text: choice.message.content,
    calls: (choice.message.tool_calls ?? []).map((c) => ({
      name: c.function.name, input: JSON.parse(c.function.arguments), id: c.id,
    })),
    usage: final.usage ? { input: final.usage.prompt_tokens, output: final.usage.completion_tokens } : undefined,
  });
  if (run_tools !== undefined) {
    Object.assign(seen, {
      rounds: stream.allChatCompletions().length,
      roles: stream.messages.map((m) => m.role),
      final_content: await stream.finalContent(),
    });
  }
});
