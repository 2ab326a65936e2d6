/* A small Markdown renderer for model output: fenced code blocks, headings, lists, quotes, tables, rules,
   paragraphs; inline code, bold, italic, strike-through and http(s) links. Every piece of the input is
   HTML-escaped before any tag is made, so the output holds no tag or attribute the input wrote. */
"use strict";

const MoerunMarkdown = (() => {
  const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  const escape = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

  function inlineText(s) {  /* s: already escaped */
    s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g,
      (_, text, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${text}</a>`);
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_([^_\s][^_\n]*?)_(?!\w)/g, "$1<em>$2</em>");
    return s.replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
  }

  function inline(src) {
    const out = [];
    const re = /(`+)([\s\S]*?[^`])\1(?!`)/g;
    let last = 0, m;
    while ((m = re.exec(src)) !== null) {
      out.push(inlineText(escape(src.slice(last, m.index))));
      out.push(`<code>${escape(m[2].trim() || m[2])}</code>`);
      last = re.lastIndex;
    }
    out.push(inlineText(escape(src.slice(last))));
    return out.join("");
  }

  const FENCE = /^\s{0,3}(```+|~~~+)\s*([\w+#.-]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

  function cells(line) {
    return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => inline(c.trim()));
  }

  function codeBlock(lang, body) {
    const label = lang ? `<span class="lang">${escape(lang)}</span>` : "<span class=\"lang\">code</span>";
    return `<div class="code"><div class="code-head">${label}<button type="button" class="copy">Copy</button>` +
      `</div><pre><code>${escape(body)}</code></pre></div>`;
  }

  function list(lines, i) {
    const ordered = /\d/.test(ITEM.exec(lines[i])[2]);
    const indent = ITEM.exec(lines[i])[1].length;
    const items = [];
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
        items.push([m[3]]);
        i++;
      } else if (items.length && lines[i].trim() && (/^\s/.test(lines[i]) || !blockStart(lines[i]))) {
        items[items.length - 1].push(lines[i].replace(new RegExp(`^\\s{0,${indent + 4}}`), ""));
        i++;
      } else {
        break;
      }
    }
    const tag = ordered ? "ol" : "ul";
    const body = items.map((it) => {
      const nested = it.slice(1).some((l) => ITEM.test(l));
      return `<li>${nested ? render(it.join("\n")) : inline(it.join(" "))}</li>`;
    }).join("");
    return [`<${tag}>${body}</${tag}>`, i];
  }

  function blockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) || QUOTE.test(line);
  }

  function render(src) {
    const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(m[1]) && !lines[i].trim().slice(m[1].length).trim())) {
          body.push(lines[i++]);
        }
        i++;  /* the closing fence (a stream may not have sent it yet) */
        out.push(codeBlock(m[2], body.join("\n")));
      } else if ((m = HEADING.exec(line))) {
        const n = m[1].length;
        out.push(`<h${n}>${inline(m[2])}</h${n}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
        out.push(`<blockquote>${render(body.join("\n"))}</blockquote>`);
      } else if (ITEM.test(line)) {
        const [html, next] = list(lines, i);
        out.push(html);
        i = next;
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const head = cells(line).map((c) => `<th>${c}</th>`).join("");
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
          rows.push(`<tr>${cells(lines[i++]).map((c) => `<td>${c}</td>`).join("")}</tr>`);
        }
        out.push(`<table><thead><tr>${head}</tr></thead><tbody>${rows.join("")}</tbody></table>`);
      } else {
        const para = [];
        while (i < lines.length && lines[i].trim() && !blockStart(lines[i])) para.push(lines[i++]);
        out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      }
    }
    return out.join("\n");
  }

  return {render, escape, inline};
})();
