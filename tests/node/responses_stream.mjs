// OpenAI's Node SDK on the Responses API: client.responses.create({stream: true}) read event by
// event; then, with resume_after N, the same response read again after event N both ways the SDK
// has: client.responses.stream({response_id, starting_after: N}) (its helper, which asks for the
// whole stream again and drops events 0..N itself) and client.responses.retrieve(id, {stream:
// true, starting_after: N}) (the server does the skipping).
// Options: resume_after; cancel_after K (client.responses.cancel(id) once K events have come, then
// reading on to the end); whole (true: first the same request unstreamed); and parameters of the
// call (default: input "Tell me about lighthouses.", max_output_tokens 20, temperature 0, seed 3:
// not a Responses parameter, but the SDK sends what it is given and the server takes it).
// Prints text and deltas (response.output_text.delta events), events and event_types, order (the
// event types in order, a run of one type once), sequence_numbers, final_type (the last event's
// type), id, status and finish_reason (the final response's status and incomplete_details.reason),
// usage and sdk_usage (its usage), final_text (its output_text parts), calls ([{name, input,
// call_id}] of its function_call items, input parsed from their arguments), requests (what the SDK
// asked: "METHOD /path?query"); whole_text (the unstreamed response's output_text) and
// whole_calls; cancelled ({id, status, object} of what cancel returned); resumed: {helper,
// retrieve}, each {sequence_numbers, order, text} of the events it gave and same_events (whether
// they are, as JSON, exactly the first read's events after N), helper with final_status (its
// finalResponse()'s status).

import OpenAI from "openai";
import { count, main, sdk } from "./common.mjs";

const INPUT = "Tell me about lighthouses."; // what tests/test_responses.py asks

// [{name, input, call_id}] of a response's function_call items
const callsOf = (r) =>
  r.output
    .filter((o) => o.type === "function_call")
    .map((o) => ({ name: o.name, input: JSON.parse(o.arguments), call_id: o.call_id }));

// The event types in order, a run of one type once
const runs = (events) => events.map((e) => e.type).filter((t, i, all) => t !== all[i - 1]);

// What a second read gave (its events and their JSON as they came: the helper's accumulator
// goes on to fill in the items it gave), next to the first read's JSON of the events after `after`
function resumed(events, json, first, after) {
  const expected = first.filter((e) => e.sequence_number > after).map((e) => JSON.stringify(e));
  return {
    sequence_numbers: events.map((e) => e.sequence_number),
    order: runs(events),
    text: events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join(""),
    same_events: JSON.stringify(json) === JSON.stringify(expected), // each one equal, all there
  };
}

// [events, their JSON as each came] of a stream
async function read(stream) {
  const events = [];
  const json = [];
  for await (const event of stream) {
    events.push(event);
    json.push(JSON.stringify(event));
  }
  return [events, json];
}

main(async (base, { resume_after, cancel_after, whole = false, ...options }, seen) => {
  Object.assign(seen, { sdk: sdk("openai"), text: "", deltas: 0, events: 0, event_types: {} });
  seen.requests = [];
  const fetchNoted = (url, init) => {
    const u = new URL(url);
    seen.requests.push(`${init?.method ?? "GET"} ${u.pathname}${u.search}`);
    return fetch(url, init);
  };
  const client = new OpenAI({
    baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000, fetch: fetchNoted,
  });
  const params = { model: "any", input: INPUT, max_output_tokens: 20, temperature: 0, seed: 3, ...options };
  if (whole) {
    const r = await client.responses.create(params);
    Object.assign(seen, { whole_text: r.output_text, whole_calls: callsOf(r) });
  }
  const stream = await client.responses.create({ ...params, stream: true });
  const first = [];
  for await (const event of stream) {
    first.push(event);
    if (first.length === cancel_after) {
      const cancelled = await client.responses.cancel(first[0].response.id);
      seen.cancelled = { id: cancelled.id, status: cancelled.status, object: cancelled.object };
    }
    seen.events += 1;
    count(seen.event_types, event.type);
    if (event.type === "response.output_text.delta") {
      seen.text += event.delta;
      seen.deltas += 1;
    }
  }
  const last = first.at(-1);
  const r = last.response;
  Object.assign(seen, {
    order: runs(first),
    sequence_numbers: first.map((e) => e.sequence_number),
    final_type: last.type,
    id: r.id,
    status: r.status,
    finish_reason: r.incomplete_details?.reason ?? null,
    usage: { input: r.usage?.input_tokens, output: r.usage?.output_tokens },
    sdk_usage: r.usage,
    calls: callsOf(r),
    final_text: r.output
      .flatMap((o) => o.content ?? [])
      .filter((c) => c.type === "output_text")
      .map((c) => c.text)
      .join(""),
  });
  if (resume_after === undefined) return;
  const helper = client.responses.stream({ response_id: r.id, starting_after: resume_after });
  const fromHelper = await read(helper);
  const retrieved = await client.responses.retrieve(r.id, { stream: true, starting_after: resume_after });
  const fromRetrieve = await read(retrieved);
  const { status: final_status } = await helper.finalResponse();
  seen.resumed = {
    helper: { ...resumed(...fromHelper, first, resume_after), final_status },
    retrieve: resumed(...fromRetrieve, first, resume_after),
  };
});
