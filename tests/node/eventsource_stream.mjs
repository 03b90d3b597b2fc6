// The `eventsource` package (the WHATWG EventSource for Node) reading the server's resumable
// GET /stream?prompt=... until its [DONE] event, reconnecting with Last-Event-ID as EventSource
// does whenever the connection ends early (the server's `retry: 1000` sets the wait).
// Options: the query's parameters (default: prompt "The lighthouse keeper wrote in his log",
// max_tokens 40, seed 3, ignore_eos true); path (default "/stream"); timeout_s (default 30: how
// long to wait for [DONE], EventSource itself reconnecting for ever).
// Prints text and deltas (the `message` events' text), events (every event, [DONE] and the
// `stream` event included), stream (the id the `stream` event named), ids (the first and last event
// ids), done (whether [DONE] arrived), connections (requests the EventSource made) and
// last_event_ids (the Last-Event-ID header of each reconnection), errors (error events: one per
// reconnection), error (what ended it otherwise).

import { EventSource } from "eventsource";
import { main, sdk } from "./common.mjs";

main(async (base, { path = "/stream", timeout_s = 30, ...query }, seen) => {
  Object.assign(seen, { sdk: sdk("eventsource"), text: "", deltas: 0, events: 0, done: false });
  Object.assign(seen, { connections: 0, last_event_ids: [], errors: 0, ids: [] });
  const params = { prompt: "The lighthouse keeper wrote in his log", max_tokens: 40, seed: 3, ignore_eos: true };
  Object.assign(params, query);
  const url = `${base}${path}?${new URLSearchParams(Object.entries(params).map(([k, v]) => [k, String(v)]))}`;
  const fetchCounted = (input, init) => {
    seen.connections += 1;
    const last = new Headers(init?.headers).get("last-event-id");
    if (last) seen.last_event_ids.push(last);
    return fetch(input, init);
  };
  await new Promise((resolve, reject) => {
    const es = new EventSource(url, { fetch: fetchCounted });
    const timer = setTimeout(() => end(new Error(`no [DONE] within ${timeout_s} s`)), timeout_s * 1000);
    const end = (error) => {
      clearTimeout(timer);
      es.close();
      error ? reject(error) : resolve();
    };
    const note = (event) => {
      seen.events += 1;
      seen.ids[0] ??= event.lastEventId;
      seen.ids[1] = event.lastEventId;
    };
    es.addEventListener("stream", (event) => {
      note(event);
      seen.stream = JSON.parse(event.data).id;
    });
    es.addEventListener("message", (event) => {
      note(event);
      if (event.data === "[DONE]") {
        seen.done = true;
        return end();
      }
      seen.text += JSON.parse(event.data).text;
      seen.deltas += 1;
    });
    es.addEventListener("error", (event) => {
      seen.errors += 1;
      // CLOSED: EventSource gave up (a status other than 200, a wrong content type): nothing more comes
      if (es.readyState === es.CLOSED) end(Object.assign(new Error(event.message ?? "closed"), { status: event.code }));
    });
  });
});
