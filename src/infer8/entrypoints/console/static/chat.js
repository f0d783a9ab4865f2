// The chat playground: streams answers from /v1/chat/completions.
"use strict";

const chat = {
  model: null,
  history: [],  // {role, content}
  controller: null,
};

// Sampling inputs of the side panel and the request fields they set.
const SAMPLING_FIELDS = [["temperature", "temperature"], ["top-p", "top_p"]];

function $(id) { return document.getElementById(id); }

// Show the server's effective defaults as the sampling fields' placeholders.
async function loadDefaults() {
  const response = await infer8.fetch("/console/api/defaults");
  if (!response.ok) return;
  const defaults = await response.json();
  for (const [id, field] of SAMPLING_FIELDS) {
    const value = defaults.sampling[field];
    if (value !== undefined) $(id).placeholder = String(value);
  }
  const from = Object.keys(defaults.generation_config).length
    ? "the model's generation config"
    : "the API's defaults (the model sets none)";
  $("sampling-note").textContent =
    "Empty fields are left out of the request, so the server's defaults apply: " + from + ".";
  document.body.dataset.defaults = "loaded";
}

function addMessage(role, text) {
  $("empty").hidden = true;
  const message = document.createElement("div");
  message.className = "message " + role;
  const avatar = document.createElement("div");
  avatar.className = "avatar";
  avatar.textContent = role === "user" ? "You" : "AI";
  const body = document.createElement("div");
  body.className = "body";
  const content = document.createElement("div");
  content.className = "content";
  if (role === "user") content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  body.append(content, meta);
  message.append(avatar, body);
  $("messages").appendChild(message);
  $("messages").scrollTop = $("messages").scrollHeight;
  return { message, content, meta };
}

function setMeta(meta, items) {
  meta.replaceChildren();
  for (const [name, value] of items) {
    const span = document.createElement("span");
    span.append(name + " ");
    const b = document.createElement("b");
    b.textContent = value;
    span.appendChild(b);
    meta.appendChild(span);
  }
}

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = {
    model: chat.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 256),
  };
  // An empty sampling field is left out: the server's defaults for the model apply.
  for (const [id, field] of SAMPLING_FIELDS) {
    const value = $(id).value.trim();
    if (value !== "") body[field] = Number(value);
  }
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  const salt = $("cache-salt").value.trim();
  if (salt) body.cache_salt = salt;
  return body;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

async function send(text) {
  chat.history.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.content.classList.add("streaming");
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstTokenAt = null;
  let answer = "";
  let usage = null;
  let finishReason = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      markdown.render(view.content, answer);
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  };
  try {
    const response = await infer8.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || "HTTP " + response.status);
    }
    await infer8.readEvents(response, (_name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (firstTokenAt === null) firstTokenAt = performance.now();
          answer += delta;
          redraw();
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    });
  } catch (err) {
    if (err.name === "AbortError") {
      finishReason = "stopped";
    } else {
      view.content.classList.add("error");
      answer += (answer ? "\n\n" : "") + "Error: " + err.message;
    }
  } finally {
    chat.controller = null;
    setBusy(false);
  }
  view.content.classList.remove("streaming");
  markdown.render(view.content, answer);
  view.message.dataset.finishReason = finishReason || "";
  chat.history.push({ role: "assistant", content: answer });
  const ended = performance.now();
  const items = [];
  if (firstTokenAt !== null) items.push(["TTFT", infer8.formatSeconds((firstTokenAt - started) / 1000)]);
  if (usage) {
    const decodeS = firstTokenAt !== null ? (ended - firstTokenAt) / 1000 : 0;
    if (usage.completion_tokens > 1 && decodeS > 0) {
      items.push(["decode", ((usage.completion_tokens - 1) / decodeS).toFixed(1) + " tok/s"]);
    }
    items.push(["prompt", String(usage.prompt_tokens)]);
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached) items.push(["cached", String(cached)]);
    items.push(["output", String(usage.completion_tokens)]);
  }
  items.push(["total", infer8.formatSeconds((ended - started) / 1000)]);
  if (finishReason) items.push(["finish", finishReason]);
  setMeta(view.meta, items);
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", async () => {
  const models = await infer8.unlock();
  chat.model = models.data[0].id;
  // the base model first, then each LoRA adapter (named with its parent)
  const select = $("model-select");
  for (const card of models.data) {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.parent ? `${card.id} (LoRA on ${card.parent})` : card.id;
    select.appendChild(option);
  }
  select.addEventListener("change", () => { chat.model = select.value; });
  loadDefaults();
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || chat.controller) return;
    prompt.value = "";
    prompt.style.height = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  prompt.addEventListener("input", () => {
    prompt.style.height = "auto";
    prompt.style.height = Math.min(prompt.scrollHeight, 200) + "px";
  });
  $("stop").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
  });
  $("reset-sampling").addEventListener("click", () => {
    for (const [id] of SAMPLING_FIELDS) $(id).value = "";
  });
  $("new-chat").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    for (const node of [...$("messages").querySelectorAll(".message")]) node.remove();
    $("empty").hidden = false;
  });
  prompt.focus();
});
