// A small, safe markdown renderer: model output is untrusted, so it only ever becomes text
// nodes inside elements created here (no innerHTML, no links, no raw HTML).
"use strict";

const markdown = (() => {
  const FENCE = /```([\w+#.-]*)[^\n]*\n?([\s\S]*?)(?:```|$)/g;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // **bold**, *italic* / _italic_, `code`; everything else is literal text.
  function appendInline(parent, text) {
    const pattern = /(`+)([^`]+?)\1|\*\*([^*]+?)\*\*|__([^_]+?)__|\*([^*\s][^*]*?)\*|\b_([^_]+?)_\b/g;
    let last = 0;
    let match;
    while ((match = pattern.exec(text)) !== null) {
      if (match.index > last) parent.appendChild(document.createTextNode(text.slice(last, match.index)));
      if (match[2] !== undefined) parent.appendChild(el("code", "inline", match[2]));
      else if (match[3] !== undefined || match[4] !== undefined) parent.appendChild(el("strong", "", match[3] || match[4]));
      else parent.appendChild(el("em", "", match[5] || match[6]));
      last = pattern.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function appendLines(parent, lines) {
    lines.forEach((line, i) => {
      if (i > 0) parent.appendChild(document.createElement("br"));
      appendInline(parent, line);
    });
  }

  function appendBlocks(parent, text) {
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        const level = Math.min(heading[1].length + 2, 6);  // h3..h6 inside a message
        const h = el("h" + level);
        appendInline(h, heading[2]);
        parent.appendChild(h);
        i++;
        continue;
      }
      const bullet = /^\s*([-*+]|\d+[.)])\s+/;
      if (bullet.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul");
        while (i < lines.length && bullet.test(lines[i])) {
          const item = el("li");
          appendInline(item, lines[i].replace(bullet, ""));
          list.appendChild(item);
          i++;
        }
        parent.appendChild(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quote = el("blockquote");
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
        appendLines(quote, quoted);
        parent.appendChild(quote);
        continue;
      }
      const para = [];
      while (i < lines.length && lines[i].trim() && !/^(#{1,6})\s/.test(lines[i]) && !bullet.test(lines[i]) && !/^\s*>/.test(lines[i])) {
        para.push(lines[i++]);
      }
      const p = el("p");
      appendLines(p, para);
      parent.appendChild(p);
    }
  }

  // Replace container's children with the rendered text.
  function render(container, text) {
    const fragment = document.createDocumentFragment();
    let last = 0;
    let match;
    FENCE.lastIndex = 0;
    while ((match = FENCE.exec(text)) !== null) {
      if (match[0] === "") { FENCE.lastIndex++; continue; }
      appendBlocks(fragment, text.slice(last, match.index));
      const pre = el("pre", "code-block");
      if (match[1]) pre.appendChild(el("span", "code-lang", match[1]));
      pre.appendChild(el("code", "", match[2].replace(/\n$/, "")));
      fragment.appendChild(pre);
      last = FENCE.lastIndex;
    }
    appendBlocks(fragment, text.slice(last));
    container.replaceChildren(fragment);
  }

  return { render };
})();
