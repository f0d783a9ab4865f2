// Minimal canvas charts for the engine view: time series (lines or stacked bars) and bars.
"use strict";

const charts = (() => {
  const GRID = "#232c3a";
  const LABEL = "#8b98aa";

  function prepare(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height };
  }

  function niceMax(value) {
    if (value <= 0) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 4, 8, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  function axes(ctx, width, height, max, pad, unit) {
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = LABEL;
    ctx.strokeStyle = GRID;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = pad.top + ((height - pad.top - pad.bottom) * i) / 4;
      ctx.beginPath();
      ctx.moveTo(pad.left, Math.round(y) + 0.5);
      ctx.lineTo(width - pad.right, Math.round(y) + 0.5);
      ctx.stroke();
      const value = max * (1 - i / 4);
      const text = value >= 1000 ? (value / 1000).toFixed(value >= 10000 ? 0 : 1) + "k" : String(+value.toFixed(1));
      ctx.fillText(text + (i === 0 && unit ? " " + unit : ""), pad.left - 6, y);
    }
  }

  // series: [{color, values, fill?}] over the same x; opts: {stacked, windowSize, unit, minMax}
  function timeSeries(canvas, series, opts) {
    const { ctx, width, height } = prepare(canvas);
    const pad = { left: 44, right: 8, top: 8, bottom: 8 };
    const n = opts.windowSize;
    let max = opts.minMax || 1;
    if (opts.stacked) {
      const len = series[0].values.length;
      for (let i = 0; i < len; i++) max = Math.max(max, series.reduce((s, x) => s + (x.values[i] || 0), 0));
    } else {
      for (const s of series) for (const v of s.values) max = Math.max(max, v);
    }
    max = niceMax(max);
    axes(ctx, width, height, max, pad, opts.unit);
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const x = (i, len) => pad.left + plotW * ((n - len + i) / Math.max(1, n - 1));
    const y = (v) => pad.top + plotH * (1 - v / max);
    if (opts.stacked) {
      const len = series[0].values.length;
      const barW = Math.max(1, plotW / n - 1);
      const base = new Array(len).fill(0);
      for (const s of series) {
        ctx.fillStyle = s.color;
        for (let i = 0; i < len; i++) {
          const v = s.values[i] || 0;
          if (!v) continue;
          const top = y(base[i] + v);
          ctx.fillRect(x(i, len) - barW / 2, top, barW, y(base[i]) - top);
          base[i] += v;
        }
      }
      return;
    }
    for (const s of series) {
      const len = s.values.length;
      if (!len) continue;
      if (s.fill) {
        ctx.beginPath();
        ctx.moveTo(x(0, len), y(0));
        s.values.forEach((v, i) => ctx.lineTo(x(i, len), y(v)));
        ctx.lineTo(x(len - 1, len), y(0));
        ctx.closePath();
        ctx.fillStyle = s.fill;
        ctx.fill();
      }
      ctx.beginPath();
      s.values.forEach((v, i) => (i ? ctx.lineTo(x(i, len), y(v)) : ctx.moveTo(x(i, len), y(v))));
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.8;
      ctx.stroke();
    }
  }

  // One bar per value (e.g. per layer), labelled every few bars.
  function bars(canvas, values, color) {
    const { ctx, width, height } = prepare(canvas);
    const pad = { left: 44, right: 8, top: 8, bottom: 18 };
    const max = niceMax(Math.max(4, ...values));
    axes(ctx, width, height - 10, max, pad, "");
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const barW = plotW / Math.max(1, values.length);
    ctx.fillStyle = color;
    values.forEach((v, i) => {
      const h = (plotH * v) / max;
      ctx.fillRect(pad.left + i * barW + 1, pad.top + plotH - h, Math.max(1, barW - 2), h);
    });
    ctx.fillStyle = LABEL;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.ceil(values.length / 10);
    for (let i = 0; i < values.length; i += every) {
      ctx.fillText(String(i), pad.left + (i + 0.5) * barW, pad.top + plotH + 4);
    }
  }

  return { timeSeries, bars, prepare };
})();
