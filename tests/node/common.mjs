// What every script here shares: the command line, the one JSON line it prints, errors as data.
//
// A script is `node tests/node/NAME.mjs BASE_URL [OPTIONS_JSON]`: BASE_URL is the server's root
// (http://127.0.0.1:PORT, no /v1: each script adds what its SDK wants), OPTIONS_JSON an object of
// the script's options (each script says which; most are passed on as the SDK call's own
// parameters, in that SDK's names). It prints exactly one JSON line on stdout, what the client
// saw, in these fields (a script leaves out what its client cannot see):
//
//   sdk            "name@version" of the package doing the work
//   text           the answer's text: the streamed deltas concatenated, or the whole answer's
//   deltas         how many text deltas arrived (streams)
//   events         how many events or chunks arrived, of any kind (streams); event_types counts each
//   usage          {input, output}: the token counts the SDK reported, by one name for every SDK
//   sdk_usage      the usage object exactly as the SDK gave it
//   finish_reason  as the SDK gave it ("length", "max_tokens", "stop", ...)
//   error          null, or {name, message, status, type} of what the SDK threw or reported
//   seconds        from the request to the end (or the error)
//
// plus fields of its own. An error of the client (a refused request, a stream that broke) is in
// `error` and the exit status is 0; a non-zero exit means the script itself failed (bad
// arguments, a crash), with the reason on stderr. Warnings the AI SDK would print go into
// `warnings` instead, so that stdout stays one line. Every client gives up after 30 s (tests wait 60).
//
// A new case is a script NAME.mjs here calling main() (a new SDK: a pinned entry in package.json,
// then `npm install --prefix tests/node` to update package-lock.json), or one more provider in
// ai_stream_text.mjs's PROVIDERS; then a test in tests/test_node.py, `node("NAME", port, **options)`.

import { readFileSync } from "node:fs";

const HERE = new URL(".", import.meta.url);

// The version of an installed package, from its package.json (exports may hide it from import).
export function sdk(name) {
  const { version } = JSON.parse(readFileSync(new URL(`node_modules/${name}/package.json`, HERE), "utf8"));
  return `${name}@${version}`;
}

// {name, message, status, type} of what a client threw or reported: its class's name (some SDKs
// leave `name` at "Error"), or "object" for a plain object (an error event's payload, as the AI
// SDK's providers report a server's error mid-stream), with that object's `type`.
export function errorOf(e) {
  if (e == null) return null;
  const cls = e.constructor && e.constructor !== Object ? e.constructor.name : "object";
  const out = { name: e.name && e.name !== "Error" ? e.name : cls, message: String(e.message ?? e) };
  const status = e.status ?? e.statusCode;
  if (status !== undefined) out.status = status;
  if (typeof e.type === "string") out.type = e.type;
  return out;
}

// A mistake in the script's arguments: say so on stderr and exit 2 (not a client's error).
export function usage(message) {
  console.error(`${process.argv[1]}: ${message}`);
  process.exit(2);
}

// Run `body(base, options, seen)`: `seen` is the result being filled in (so that what arrived before
// an error is kept); `body` may return fields to add. Prints the one line and exits.
export async function main(body) {
  const [base, json] = process.argv.slice(2);
  if (!base || !/^https?:\/\//.test(base)) usage("usage: node SCRIPT BASE_URL [OPTIONS_JSON]");
  let options = {};
  try {
    options = json ? JSON.parse(json) : {};
  } catch (e) {
    usage(`OPTIONS_JSON is not JSON: ${e.message}`);
  }
  const warnings = [];
  globalThis.AI_SDK_LOG_WARNINGS = ({ warnings: ws }) => warnings.push(...ws);
  const seen = { error: null };
  const started = performance.now();
  try {
    Object.assign(seen, (await body(base.replace(/\/+$/, ""), options, seen)) ?? {});
  } catch (e) {
    seen.error = errorOf(e);
  }
  seen.seconds = Number(((performance.now() - started) / 1000).toFixed(3));
  if (warnings.length) seen.warnings = warnings;
  process.stdout.write(JSON.stringify(seen) + "\n", () => process.exit(0));
}

// A stream's event kinds, counted: {type: n}.
export function count(types, type) {
  types[type] = (types[type] ?? 0) + 1;
}

// The chat request every script makes unless told otherwise: what tests/test_apis.py asks, greedy.
export const MESSAGES = [{ role: "user", content: "Tell me about lighthouses." }];
