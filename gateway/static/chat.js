// The gateway's built-in chat page. No build step, no dependencies.
//
// It talks only to the gateway that served it (relative URLs, and the page's CSP allows no
// other origin). The API key stays in this browser: sessionStorage, or localStorage when
// "remember" is ticked, and it is sent only as the Authorization header of those calls.
// Model text is never put into the page as HTML: renderMarkdown escapes it first.
"use strict";

const API = "v1/";
const KEY_STORE = "gateway-chat.api-key";
const MODEL_STORE = "gateway-chat.model";
const CHAT_STORE = "gateway-chat.conversation";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"),
  key: $("api-key"),
  remember: $("remember-key"),
  newChat: $("new-chat"),
  notice: $("notice"),
  conversation: $("conversation"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
};

// Each entry: {role: "user" | "assistant", content, ...}. A user turn the gateway refused has
// `blocked` ({message, code}) and is not sent again; an assistant turn may have `finish`
// ("stop", "length", "content_filter", "stopped", "error"), `error`, `sources`, `usage`.
let conversation = loadConversation();
let inFlight = null; // the AbortController of the answer being streamed

// --- storage ---------------------------------------------------------------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || localStorage.getItem(KEY_STORE) || "";
}

function saveKey() {
  const key = ui.key.value.trim();
  sessionStorage.removeItem(KEY_STORE);
  localStorage.removeItem(KEY_STORE);
  if (key) (ui.remember.checked ? localStorage : sessionStorage).setItem(KEY_STORE, key);
}

function loadConversation() {
  try {
    const saved = JSON.parse(localStorage.getItem(CHAT_STORE) || "[]");
    return Array.isArray(saved) ? saved : [];
  } catch {
    return [];
  }
}

function saveConversation() {
  localStorage.setItem(CHAT_STORE, JSON.stringify(conversation));
}

// --- Markdown, safely ----------------------------------------------------------------

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Inline Markdown over text that is already escaped: the patterns only wrap it in our tags.
function renderInline(escaped) {
  return escaped
    .split(/(`[^`\n]+`)/)
    .map((part, i) => {
      if (i % 2 === 1) return `<code>${part.slice(1, -1)}</code>`;
      return part
        .replace(/\*\*(?=\S)([^\n]*?\S)\*\*/g, "<strong>$1</strong>")
        .replace(/__(?=\S)([^\n]*?\S)__/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
        .replace(/(^|[^*\w])\*([^\s*])\*(?!\*)/g, "$1<em>$2</em>")
        .replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![_\w])/g, "$1<em>$2</em>");
    })
    .join("");
}

// Code blocks, inline code, bold, italics, headings, lists and paragraphs. Links and raw HTML
// are deliberately not supported: model text cannot create a link or an element.
function renderMarkdown(source) {
  const lines = escapeHtml(source).split("\n");
  const out = [];
  let paragraph = [];
  let list = null; // {tag, items}
  let code = null; // lines of an open fenced block

  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((item) => `<li>${renderInline(item)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };

  for (const line of lines) {
    if (code !== null) {
      if (/^\s*```/.test(line)) {
        out.push(`<pre><code>${code.join("\n")}</code></pre>`);
        code = null;
      } else {
        code.push(line);
      }
      continue;
    }
    if (/^\s*```/.test(line)) {
      flushParagraph();
      flushList();
      code = [];
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
    const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
    if (heading) {
      flushParagraph();
      flushList();
      const level = Math.min(heading[1].length + 2, 6); // h3..h6 inside a message
      out.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
    } else if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (!line.trim()) {
      flushParagraph();
      flushList();
    } else if (list && /^\s+\S/.test(line)) {
      list.items[list.items.length - 1] += " " + line.trim(); // a wrapped list item
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  if (code !== null) out.push(`<pre><code>${code.join("\n")}</code></pre>`); // still streaming
  flushParagraph();
  flushList();
  return out.join("");
}

// --- rendering -----------------------------------------------------------------------

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function renderEntry(entry) {
  const box = element("article", `message ${entry.role}`);
  box.append(element("div", "role", entry.role === "user" ? "You" : entry.model || "assistant"));
  if (entry.role === "user") {
    box.append(element("div", "content", entry.content));
    if (entry.blocked) {
      const { status, code, message } = entry.blocked;
      const what = status === 400 ? "Refused by the gateway" : `Not answered (HTTP ${status})`;
      box.append(element("div", "refusal", `${what}${code ? ` [${code}]` : ""}: ${message}`));
    }
    return box;
  }
  const content = element("div", "content");
  content.innerHTML = renderMarkdown(entry.content); // escaped first: see renderMarkdown
  box.append(content);
  if (entry.finish === "content_filter") {
    box.append(element("div", "cut", "Cut by the gateway's output rails (finish_reason: content_filter): the rest of this answer was withheld."));
  } else if (entry.finish === "length") {
    box.append(element("div", "stopped", "Stopped at the token limit (finish_reason: length)."));
  } else if (entry.finish === "stopped") {
    box.append(element("div", "stopped", "Stopped."));
  }
  if (entry.error) box.append(element("div", "error", entry.error));
  if (entry.sources && entry.sources.length) {
    const sources = element("div", "sources", "Sources");
    const list = element("ol");
    for (const s of entry.sources) {
      const score = typeof s.score === "number" ? `, score ${s.score.toFixed(2)}` : "";
      list.append(element("li", "", `${s.filename || s.file_id} (chunk ${s.chunk_index}${score})`));
    }
    sources.append(list);
    box.append(sources);
  }
  if (entry.usage) {
    const u = entry.usage;
    box.append(element("div", "usage", `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`));
  }
  return box;
}

function renderAll() {
  ui.conversation.replaceChildren(...conversation.map(renderEntry));
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

// Re-render only the last message while it streams.
function renderLast() {
  const last = ui.conversation.lastElementChild;
  const fresh = renderEntry(conversation[conversation.length - 1]);
  if (last) last.replaceWith(fresh);
  else ui.conversation.append(fresh);
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

function showNotice(text) {
  ui.notice.textContent = text || "";
  ui.notice.hidden = !text;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

// --- the API -----------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error) return { message: String(body.error.message), code: body.error.code || null };
  } catch {
    // not OpenAI's error body
  }
  return { message: `HTTP ${response.status}`, code: null };
}

async function loadModels() {
  let response;
  try {
    response = await fetch(API + "models", { headers: headers() });
  } catch (err) {
    showNotice(`Cannot reach the gateway: ${err.message}`);
    return;
  }
  if (response.status === 401) {
    ui.model.replaceChildren();
    showNotice(apiKey() ? "That API key was refused." : "This gateway needs an API key: enter it above.");
    ui.key.focus();
    return;
  }
  if (!response.ok) {
    const error = await errorOf(response);
    showNotice(`Could not list models: ${error.message}`);
    return;
  }
  const models = (await response.json()).data;
  const wanted = localStorage.getItem(MODEL_STORE);
  ui.model.replaceChildren(
    ...models.map((m) => {
      const label = m.max_model_len ? `${m.id} (${m.max_model_len} tokens)` : m.id;
      const option = element("option", "", label);
      option.value = m.id;
      option.selected = m.id === wanted;
      return option;
    }),
  );
  showNotice(models.length ? "" : "This key may not use any model.");
}

// The turns sent to the model: refused user turns and empty answers are left out.
function history() {
  return conversation
    .filter((m) => !m.blocked && !m.pending && (m.role === "user" || m.content))
    .map((m) => ({ role: m.role, content: m.content }));
}

async function send(text) {
  const model = ui.model.value;
  if (!model) {
    showNotice("Pick a model first.");
    return;
  }
  showNotice("");
  const turn = { role: "user", content: text };
  conversation.push(turn);
  const messages = history();
  const answer = { role: "assistant", model, content: "", pending: true };
  conversation.push(answer);
  renderAll();
  setBusy(true);
  inFlight = new AbortController();
  try {
    const response = await fetch(API + "chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model,
        messages,
        stream: true,
        stream_options: { include_usage: true },
        retrieval: { return_sources: true },
      }),
      signal: inFlight.signal,
    });
    if (!response.ok) {
      // Refused (an input rail's 400 names its policy in `code`) or failed: no answer, and this
      // turn is not sent again with the next message.
      conversation.pop();
      turn.blocked = { ...(await errorOf(response)), status: response.status };
      if (response.status === 401) showNotice("The API key was refused: enter it above.");
      return;
    }
    const sources = response.headers.get("X-Retrieval-Sources");
    if (sources) answer.sources = JSON.parse(sources);
    await readStream(response, answer);
  } catch (err) {
    if (err.name === "AbortError") answer.finish = "stopped";
    else answer.error = `The connection failed: ${err.message}`;
  } finally {
    delete answer.pending;
    inFlight = null;
    setBusy(false);
    saveConversation();
    renderAll();
  }
}

// OpenAI's stream: server-sent events, `data: {json}` blocks ending with `data: [DONE]`.
async function readStream(response, answer) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r/g, "");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      applyEvent(JSON.parse(data), answer);
      renderLast();
    }
  }
}

function applyEvent(event, answer) {
  if (event.error) {
    answer.error = `The gateway reported an error: ${event.error.message}`;
    answer.finish = "error";
    return;
  }
  if (event.usage) answer.usage = event.usage;
  const choice = (event.choices || [])[0];
  if (!choice) return;
  if (choice.delta && typeof choice.delta.content === "string") answer.content += choice.delta.content;
  if (choice.finish_reason) answer.finish = choice.finish_reason;
}

// --- wiring ------------------------------------------------------------------------------

ui.key.value = apiKey();
ui.remember.checked = Boolean(localStorage.getItem(KEY_STORE));
ui.key.addEventListener("change", () => {
  saveKey();
  loadModels();
});
ui.remember.addEventListener("change", saveKey);
ui.model.addEventListener("change", () => localStorage.setItem(MODEL_STORE, ui.model.value));
ui.newChat.addEventListener("click", () => {
  if (inFlight) inFlight.abort();
  conversation = [];
  saveConversation();
  renderAll();
  ui.prompt.focus();
});
ui.stop.addEventListener("click", () => {
  // Aborting closes the connection; the gateway then cancels the engine call.
  if (inFlight) inFlight.abort();
});
ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || inFlight) return;
  ui.prompt.value = "";
  send(text);
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});

renderAll();
loadModels();
