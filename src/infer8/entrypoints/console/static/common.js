// Shared by both console pages: the API key gate, authorised fetch, the header.
"use strict";

const KEY_STORAGE = "infer8-api-key";

const infer8 = {
  apiKey() {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  },

  headers(extra) {
    const headers = Object.assign({}, extra || {});
    const key = infer8.apiKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    return headers;
  },

  // fetch() with the key; a 401 shows the key prompt again.
  async fetch(url, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = infer8.headers(opts.headers);
    const response = await fetch(url, opts);
    if (response.status === 401) infer8.showKeyDialog("The server refused the key.");
    return response;
  },

  // Resolve with the served model list once the server accepts our key (asking for it if needed).
  async unlock() {
    // Ask before probing when a key is needed and none is kept: no request fails needlessly.
    if (INFER8_KEY_REQUIRED && !infer8.apiKey()) await infer8.askForKey("");
    for (;;) {
      let response;
      try {
        response = await fetch("/v1/models", { headers: infer8.headers() });
      } catch (err) {
        infer8.setStatus("offline", "server unreachable");
        await new Promise((r) => setTimeout(r, 2000));
        continue;
      }
      if (response.ok) {
        const body = await response.json();
        document.body.classList.remove("locked");
        document.getElementById("key-dialog").classList.remove("open");
        const model = body.data && body.data[0] ? body.data[0].id : "?";
        document.getElementById("model-name").textContent = model.split("/").pop();
        document.getElementById("model-name").title = model;
        infer8.setStatus("online", "connected");
        return body;
      }
      if (response.status !== 401) {
        infer8.setStatus("offline", "HTTP " + response.status);
        await new Promise((r) => setTimeout(r, 2000));
        continue;
      }
      document.body.classList.add("locked");
      const hadKey = infer8.apiKey() !== "";
      await infer8.askForKey(hadKey ? "That key was refused; try again." : "");
    }
  },

  askForKey(message) {
    return new Promise((resolve) => {
      const dialog = document.getElementById("key-dialog");
      const form = document.getElementById("key-form");
      const input = document.getElementById("api-key-input");
      document.getElementById("key-error").textContent = message || "";
      dialog.classList.add("open");
      input.value = "";
      input.focus();
      form.onsubmit = (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY_STORAGE, input.value.trim());
        resolve();
      };
    });
  },

  showKeyDialog(message) {
    document.body.classList.add("locked");
    infer8.askForKey(message).then(() => location.reload());
  },

  setStatus(state, text) {
    const el = document.getElementById("server-status");
    if (!el) return;
    el.dataset.state = state;
    el.title = text;
  },

  // Read a text/event-stream body; call onEvent(name, data) per event. Resolves at its end.
  async readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  },

  formatNumber(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString("en-US", {
      maximumFractionDigits: digits === undefined ? 0 : digits,
      minimumFractionDigits: digits === undefined ? 0 : digits,
    });
  },

  formatSeconds(value) {
    if (value === null || value === undefined) return "–";
    if (value < 1) return (value * 1000).toFixed(value < 0.01 ? 1 : 0) + " ms";
    return value.toFixed(2) + " s";
  },
};

document.addEventListener("DOMContentLoaded", () => {
  const forget = document.getElementById("forget-key");
  if (forget) {
    forget.hidden = !INFER8_KEY_REQUIRED;
    forget.addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORAGE);
      location.reload();
    });
  }
});
