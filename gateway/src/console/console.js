// The mmgate console: a view over the gateway's own API. Everything it shows comes from the
// gateway (plans and their pictures from POST /v1/preprocess, answers from /v1/chat/completions,
// lists from /v1/models and /v1/plugins, the live charts from /metrics); nothing is recomputed here.
'use strict';

(() => {
  const $ = (selector, root = document) => root.querySelector(selector);
  const COLORS = ['#2456c9', '#d9480f', '#2b8a3e', '#9c36b5', '#0b7285', '#e67700', '#c2255c', '#5c940d'];
  const PART_TYPE = { image: 'image_url', video: 'video_url', audio: 'audio_url' };

  /** An element with attributes (`data-*`, `aria-*`, properties) and children (text or nodes). */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === undefined || value === null) continue;
      if (name === 'class') node.className = value;
      else if (name.startsWith('data-') || name.startsWith('aria-') || name === 'role' || name === 'for') node.setAttribute(name, value);
      else node[name] = value;
    }
    for (const child of children.flat()) {
      if (child !== undefined && child !== null) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // ---- The API key: kept in this tab only, sent to this gateway only. ----
  const keyInput = $('#api-key');
  keyInput.value = sessionStorage.getItem('mmgate.key') || '';
  keyInput.addEventListener('change', () => {
    sessionStorage.setItem('mmgate.key', keyInput.value.trim());
    clearAlert();
    load(currentPage());
  });

  function headers(json) {
    const result = {};
    const key = keyInput.value.trim();
    if (key) result.Authorization = `Bearer ${key}`;
    if (json) result['Content-Type'] = 'application/json';
    return result;
  }

  function failure(status, data, text) {
    const error = (data && data.error) || {};
    const err = new Error(error.message || text || `HTTP ${status}`);
    err.status = status;
    err.code = error.code;
    return err;
  }

  /** GET `path`, or POST `body` to it: its JSON, or an Error with the gateway's status and message. */
  async function api(path, body) {
    const response = await fetch(path, {
      method: body === undefined ? 'GET' : 'POST',
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    let data = null;
    try { data = JSON.parse(text); } catch { /* not JSON: the text says what happened */ }
    if (!response.ok) throw failure(response.status, data, text);
    return data;
  }

  function showError(err) {
    const box = $('#alert');
    box.textContent = err.status === 401
      ? `401 Unauthorized — ${err.message}. Enter a valid API key at the top right.`
      : `${err.status ? `${err.status}: ` : ''}${err.message}`;
    box.dataset.status = err.status || '';
    box.hidden = false;
  }

  function clearAlert() {
    $('#alert').hidden = true;
  }

  // ---- Pages: tabs that work with the keyboard (arrows, Home, End). ----
  const tabs = [...document.querySelectorAll('[role=tab]')];
  const pageOf = (tab) => tab.id.slice('tab-'.length);
  const currentPage = () => pageOf(tabs.find((t) => t.getAttribute('aria-selected') === 'true'));

  function select(tab, focus) {
    for (const t of tabs) {
      const on = t === tab;
      t.setAttribute('aria-selected', String(on));
      t.tabIndex = on ? 0 : -1;
      $(`#${t.getAttribute('aria-controls')}`).hidden = !on;
    }
    if (focus) tab.focus();
    history.replaceState(null, '', `#${pageOf(tab)}`);
    clearAlert();
    load(pageOf(tab));
  }

  tabs.forEach((tab, i) => {
    tab.addEventListener('click', () => select(tab, false));
    tab.addEventListener('keydown', (event) => {
      const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[event.key];
      if (next === undefined) return;
      event.preventDefault();
      select(tabs[(next + tabs.length) % tabs.length], true);
    });
  });

  function load(page) {
    // The Try page's model list is the Models page's: both read /v1/models anew.
    if (page === 'try' || page === 'models') loadModels();
    if (page === 'plugins') loadPlugins();
    if (page === 'live') startLive(); else stopLive();
  }

  // ---- Models ----
  let models = [];

  async function loadModels() {
    try {
      models = (await api('/v1/models')).data;
    } catch (err) {
      showError(err);
      return;
    }
    const selectBox = $('#model');
    const chosen = selectBox.value;
    selectBox.replaceChildren(...models.map((m) => el('option', { value: m.id },
      m.modalities && m.modalities.length ? `${m.id} (${m.modalities.join(', ')})` : m.id)));
    if (models.some((m) => m.id === chosen)) selectBox.value = chosen;
    const rows = models.map((m) => el('tr', { 'data-model': m.id },
      el('td', {}, el('code', {}, m.id)),
      el('td', {}, m.served_by),
      el('td', { 'data-context': m.context_length ?? '' }, m.context_length ? m.context_length.toLocaleString('en') : '—'),
      el('td', {}, (m.modalities || []).join(', ') || '—'),
      el('td', {}, m.media ? `${m.media}${m.images_encoded_here ? ' (images encoded here)' : ''}` : (m.served_by === 'native' ? 'encoded here' : '—')),
      el('td', {}, upstreamList(m.upstreams)),
      el('td', { class: 'apis' }, ...(m.apis || []).map((a) => el('code', {}, a)))));
    $('#models-table tbody').replaceChildren(...rows);
  }

  function upstreamList(upstreams) {
    if (!upstreams || !upstreams.length) return '—';
    return el('ul', { class: 'plain' }, upstreams.map((u) => el('li', {},
      el('code', {}, u.server || u.address), ' ',
      el('span', { class: u.healthy ? 'healthy' : 'unhealthy' }, u.healthy ? 'healthy' : 'out of rotation'))));
  }

  // ---- Plugins ----
  async function loadPlugins() {
    let list;
    try {
      list = await api('/v1/plugins');
    } catch (err) {
      showError(err);
      return;
    }
    const rows = list.data.map((p) => el('tr', { 'data-plugin': p.name },
      el('td', {}, el('code', {}, p.name)),
      el('td', {}, p.version),
      el('td', {}, p.contract_version),
      el('td', {}, p.modalities.join(', ')),
      el('td', {}, p.origin),
      el('td', { class: 'sha', title: p.sha256 }, `${p.sha256.slice(0, 16)}…`)));
    $('#plugins-table tbody').replaceChildren(...rows);
    const reload = list.reload || {};
    const when = reload.at ? `, the latest at ${new Date(reload.at * 1000).toLocaleString()}` : '';
    const rejected = (reload.rejected || []).map((r) => `${r.manifest}: ${r.reason}`).join('; ');
    $('#reload').textContent = `Host contract ${list.host_contract_version}. Hot reloads: ${reload.generation || 0}${when}.` +
      (rejected ? ` Rejected by the latest: ${rejected}.` : '');
  }

  // ---- Try: media in, the plan drawn, the answer streamed. ----
  const chosen = []; // {file, kind, url}

  function kindOf(type, name) {
    for (const kind of ['image', 'video', 'audio']) if (type.startsWith(`${kind}/`)) return kind;
    const ext = (name.split(/[?#]/)[0].split('.').pop() || '').toLowerCase();
    if (type === 'application/pdf' || ext === 'pdf') return 'document';
    if (['mp4', 'webm', 'mkv', 'mov', 'avi', 'mpeg', 'mpg', 'ogv', 'flv', '3gp'].includes(ext)) return 'video';
    if (['wav', 'mp3', 'flac', 'ogg', 'oga', 'm4a', 'aac', 'opus'].includes(ext)) return 'audio';
    return 'image';
  }

  function addFiles(files) {
    for (const file of files) chosen.push({ file, kind: kindOf(file.type, file.name), url: URL.createObjectURL(file) });
    renderChosen();
  }

  function renderChosen() {
    $('#chosen').replaceChildren(...chosen.map((c, i) => el('li', { 'data-kind': c.kind },
      `${c.file.name} (${c.kind}) `,
      el('button', {
        type: 'button', 'aria-label': `Remove ${c.file.name}`,
        onclick: () => { URL.revokeObjectURL(c.url); chosen.splice(i, 1); renderChosen(); },
      }, '×'))));
  }

  $('#files').addEventListener('change', (event) => {
    addFiles(event.target.files);
    event.target.value = '';
  });
  const drop = $('#drop');
  drop.addEventListener('dragover', (event) => { event.preventDefault(); drop.classList.add('over'); });
  drop.addEventListener('dragleave', () => drop.classList.remove('over'));
  drop.addEventListener('drop', (event) => {
    event.preventDefault();
    drop.classList.remove('over');
    addFiles(event.dataTransfer.files);
  });

  function dataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  /** The chat request the form describes, and where each media item came from (for its picture). */
  async function chatRequest() {
    const content = [{ type: 'text', text: $('#prompt').value }];
    const sources = [];
    for (const c of chosen) {
      if (c.kind === 'document') {
        // A PDF goes as OpenAI's SDK sends files: its pages become the model's images.
        content.push({ type: 'file', file: { filename: c.file.name, file_data: await dataUrl(c.file) } });
        sources.push({ name: c.file.name, url: c.url });
        continue;
      }
      const type = PART_TYPE[c.kind];
      content.push({ type, [type]: { url: await dataUrl(c.file) } });
      sources.push({ name: c.file.name, url: c.url });
    }
    for (const line of $('#urls').value.split('\n').map((l) => l.trim()).filter(Boolean)) {
      const type = PART_TYPE[kindOf('', line)];
      content.push({ type, [type]: { url: line } });
      sources.push({ name: line, url: line });
    }
    const maxTokens = Number.parseInt($('#max-tokens').value, 10);
    const request = { model: $('#model').value, messages: [{ role: 'user', content }] };
    if (Number.isFinite(maxTokens) && maxTokens > 0) request.max_tokens = maxTokens;
    return { request, sources };
  }

  const size = (s) => (s ? `${s.width}×${s.height}` : '');
  const plural = (n, word) => `${n} ${word}${n === 1 ? '' : 's'}`;

  function renderPlan(plan, sources) {
    $('#plan-empty').hidden = true;
    $('#answer').textContent = '';
    $('#usage').replaceChildren();
    const context = plan.context_length;
    const reserved = plan.max_tokens || 0;
    const used = plan.text_tokens + plan.media.reduce((sum, m) => sum + m.tokens, 0) + reserved;
    const segments = [
      { label: 'Text', tokens: plan.text_tokens, color: 'var(--text-seg)', what: 'text' },
      ...plan.media.map((m, i) => ({
        label: `Item ${i + 1} (${m.kind})`, tokens: m.tokens, color: COLORS[i % COLORS.length], what: 'item', item: m,
      })),
      { label: 'Answer (max_tokens)', tokens: reserved, color: 'var(--reserved)', what: 'reserved' },
      { label: 'Free', tokens: Math.max(0, context - used), color: 'var(--free)', what: 'free' },
    ];
    const bar = el('div', {
      class: 'bar', role: 'img',
      'aria-label': `Context of ${context} tokens: ${segments.map((s) => `${s.label} ${s.tokens}`).join(', ')}`,
    }, segments.filter((s) => s.what !== 'free').map((s) => {
      const span = el('span', { title: `${s.label}: ${s.tokens} tokens` });
      span.style.setProperty('width', `${(100 * s.tokens) / context}%`);
      span.style.setProperty('background', s.color);
      return span;
    }));
    const legend = el('ul', {}, segments.map((s) => {
      const item = el('li', { 'data-segment': s.what, 'data-tokens': s.tokens },
        `${s.label}: ${s.tokens.toLocaleString('en')} tokens`,
        s.item && s.item.reduced ? el('span', { class: 'cut' }, ' — cut to fit') : null);
      item.style.setProperty('--swatch', s.color);
      return item;
    }));
    const summary = el('p', { class: 'hint' },
      `The prompt is ${plan.prompt_tokens.toLocaleString('en')} tokens of this model's ${context.toLocaleString('en')}; ` +
      `its media shared a budget of ${plan.media_budget.toLocaleString('en')} tokens.`);
    $('#budget').replaceChildren(bar, legend, summary);
    $('#items').replaceChildren(...plan.media.map((m, i) => itemCard(m, i, sources[i] || {})));
  }

  function itemCard(m, i, source) {
    const card = el('article', {
      class: 'item', 'data-index': m.index, 'data-kind': m.kind, 'data-tokens': m.tokens,
      'aria-label': `Item ${i + 1}, ${m.kind}`,
    });
    card.style.setProperty('--swatch', COLORS[i % COLORS.length]);
    card.append(el('h3', {}, `Item ${i + 1}: ${m.kind} — `, el('span', {}, source.name || '')));
    const facts = [plural(m.tokens, 'token')];
    if (m.format) facts.push(m.format);
    if (m.duration_seconds) facts.push(`${m.duration_seconds.toFixed(2)} s`);
    if (m.plugin) facts.push(`plugin ${m.plugin.name} ${m.plugin.version}`);
    card.append(el('p', { class: 'facts' }, facts.join(' · ')));
    if (m.reason) card.append(el('p', { class: m.reduced ? 'reason cut' : 'reason' }, m.reduced ? `Cut to fit: ${m.reason}` : m.reason));
    const picture = m.picture || {};
    if (m.kind === 'image') {
      card.dataset.original = size(m.original_size);
      card.dataset.resized = size(m.resized_size);
      card.append(el('div', { class: 'pair' },
        el('figure', {},
          el('img', { src: source.url, alt: `The original image, ${size(m.original_size)}`, width: m.original_size && m.original_size.width }),
          el('figcaption', {}, `Original ${size(m.original_size)}`)),
        picture.image ? el('figure', {},
          el('img', { src: picture.image, alt: `The image as the model gets it, ${size(m.resized_size)}`, width: m.resized_size && m.resized_size.width }),
          el('figcaption', { class: 'planned' }, `As the model gets it: ${size(m.resized_size)}, ${plural(m.tokens, 'token')}`)) : null));
    } else if (m.kind === 'video') {
      const frames = picture.frames || [];
      card.dataset.frames = m.frames ?? frames.length;
      card.dataset.resized = size(m.resized_size);
      card.append(el('p', { class: 'facts' },
        `${plural(m.frames ?? frames.length, 'frame')} chosen${m.resized_size ? ` at ${size(m.resized_size)}` : ''}; original ${size(m.original_size)}`));
      card.append(el('div', { class: 'sheet' }, frames.map((f, n) => el('figure', { class: 'frame', 'data-timestamp': f.timestamp },
        el('img', { src: f.image, alt: `Frame ${n + 1} at ${f.timestamp.toFixed(2)} s` }),
        el('figcaption', {}, `#${n + 1} · ${f.timestamp.toFixed(2)} s`)))));
    } else if (m.kind === 'document') {
      const pages = picture.pages || [];
      card.dataset.pages = m.pages;
      card.dataset.kept = (m.pages_kept || []).length;
      card.append(el('p', { class: 'facts' },
        `${plural((m.pages_kept || []).length, 'page')} of ${m.pages} as the model gets them, each an image`));
      const detail = new Map((m.per_page || []).map((p) => [p.page, p]));
      card.append(el('div', { class: 'sheet' }, pages.map((p) => {
        const d = detail.get(p.page) || {};
        return el('figure', { class: 'page', 'data-page': p.page },
          p.image ? el('img', { src: p.image, alt: `Page ${p.page} as the model gets it, ${size(d.size)}` }) : null,
          el('figcaption', {}, `Page ${p.page} · ${size(d.size)} · ${plural(d.tokens || 0, 'token')}`));
      })));
    } else if (m.kind === 'audio') {
      card.dataset.chunks = m.chunks ?? '';
      card.append(el('p', { class: 'facts' },
        `${m.sample_rate ? `${m.sample_rate} Hz, ` : ''}${m.chunks ? plural(m.chunks, 'chunk') : ''} of up to 30 s`));
      if (picture.spectrogram) {
        card.append(el('figure', {},
          el('img', { class: 'spectrogram', src: picture.spectrogram, alt: 'The log-mel spectrogram the model is given' }),
          el('figcaption', {}, 'Log-mel spectrogram as the model is given it: time to the right, low frequencies at the bottom; white lines part the chunks.')));
      }
    }
    return card;
  }

  function setBusy(busy, text) {
    $('#plan-button').disabled = busy;
    $('#send-button').disabled = busy;
    $('#try-status').textContent = text || '';
  }

  /** Plans the form's request and draws it; a failure is said in place (a refused key above). */
  async function planAndShow(request, sources) {
    try {
      renderPlan(await api('/v1/preprocess', { ...request, pictures: true }), sources);
    } catch (err) {
      if (err.status === 401) {
        showError(err);
        return;
      }
      // A model whose server plans its own media, or media this one cannot take.
      $('#plan-empty').hidden = false;
      $('#plan-empty').textContent = `Not planned here: ${err.message}`;
      $('#budget').replaceChildren();
      $('#items').replaceChildren();
    }
  }

  $('#plan-button').addEventListener('click', async () => {
    clearAlert();
    setBusy(true, 'Planning…');
    try {
      const { request, sources } = await chatRequest();
      await planAndShow(request, sources);
    } finally {
      setBusy(false);
    }
  });

  $('#try-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    clearAlert();
    setBusy(true, 'Planning…');
    $('#answer').textContent = '';
    $('#usage').replaceChildren();
    try {
      const { request, sources } = await chatRequest();
      await planAndShow(request, sources);
      // A plan that failed is sent all the same, for the gateway's own word, unless the key was
      // refused.
      if (!$('#alert').hidden) return;
      setBusy(true, 'Waiting for the first token…');
      await stream(request);
    } catch (err) {
      showError(err);
    } finally {
      setBusy(false);
    }
  });

  /** Sends `request` streamed, writing the answer as it comes, then its usage. */
  async function stream(request) {
    const response = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers(true),
      body: JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } }),
    });
    if (!response.ok) {
      const text = await response.text();
      let data = null;
      try { data = JSON.parse(text); } catch { /* the text says it */ }
      throw failure(response.status, data, text);
    }
    const fromHeader = response.headers.get('x-mmgate-media');
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = '';
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      let end;
      while ((end = pending.indexOf('\n\n')) >= 0) {
        const event = pending.slice(0, end);
        pending = pending.slice(end + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw failure(chunk.error.status || 500, chunk, data);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            $('#try-status').textContent = 'Streaming…';
            $('#answer').append(delta.content);
          }
          if (chunk.usage) usage = chunk.usage;
        }
      }
    }
    renderUsage(usage, fromHeader ? JSON.parse(fromHeader) : null);
  }

  function renderUsage(usage, fromHeader) {
    if (!usage) return;
    const media = usage.media || fromHeader || [];
    const rows = media.map((m) => el('tr', { 'data-index': m.index, 'data-tokens': m.tokens },
      el('td', {}, `Item ${m.index + 1}`), el('td', {}, m.kind), el('td', {}, m.tokens),
      el('td', {}, m.resized_size ? size(m.resized_size) : (m.frames ? plural(m.frames, 'frame') : (m.chunks ? plural(m.chunks, 'chunk') : ''))),
      el('td', {}, m.dropped ? `dropped: ${m.dropped}` : (m.reduced ? 'cut to fit' : ''))));
    $('#usage').replaceChildren(
      el('p', { 'data-prompt-tokens': usage.prompt_tokens, 'data-completion-tokens': usage.completion_tokens },
        `Prompt ${usage.prompt_tokens} tokens, answer ${usage.completion_tokens} tokens.`),
      rows.length ? el('table', {},
        el('caption', {}, 'The media as sent (usage.media)'),
        el('thead', {}, el('tr', {}, ['Item', 'Kind', 'Tokens', 'Planned', ''].map((h) => el('th', { scope: 'col' }, h)))),
        el('tbody', {}, rows)) : null);
  }

  // ---- Live: the gateway's own metrics over the last minutes. ----
  const WINDOW_SECONDS = 300;
  const EVERY_MS = 2000;
  let samples = []; // {t, series: [{name, labels, value}]}
  let timer = null;

  function parseMetrics(text) {
    const series = [];
    for (const line of text.split('\n')) {
      if (!line || line.startsWith('#')) continue;
      const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!match) continue;
      const labels = {};
      for (const pair of (match[2] || '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
      series.push({ name: match[1], labels, value: Number(match[3]) });
    }
    return series;
  }

  async function sample() {
    try {
      const response = await fetch('/metrics', { headers: headers(false) });
      if (!response.ok) throw failure(response.status, null, await response.text());
      const now = Date.now() / 1000;
      samples.push({ t: now, series: parseMetrics(await response.text()) });
      samples = samples.filter((s) => s.t >= now - WINDOW_SECONDS);
      drawCharts();
    } catch (err) {
      showError(err);
    }
  }

  function startLive() {
    if (timer) return;
    sample();
    timer = setInterval(sample, EVERY_MS);
  }

  function stopLive() {
    if (timer) clearInterval(timer);
    timer = null;
  }

  /** Per sample: the sum of `name`'s series grouped by `key(labels)` (null leaves one out). */
  function grouped(sampleAt, name, key) {
    const groups = new Map();
    for (const s of sampleAt.series) {
      if (s.name !== name) continue;
      const group = key(s.labels);
      if (group === null) continue;
      groups.set(group, (groups.get(group) || 0) + s.value);
    }
    return groups;
  }

  /** Lines of a gauge, or of a counter's rate per second, by group. */
  function lines(name, key, rate) {
    const byGroup = new Map();
    samples.forEach((now, i) => {
      const values = grouped(now, name, key);
      const before = i > 0 ? grouped(samples[i - 1], name, key) : null;
      for (const [group, value] of values) {
        if (!byGroup.has(group)) byGroup.set(group, []);
        if (!rate) byGroup.get(group).push([now.t, value]);
        else if (before) byGroup.get(group).push([now.t, Math.max(0, value - (before.get(group) || 0)) / (now.t - samples[i - 1].t)]);
      }
    });
    // In name order, so that a series keeps its colour whatever order /metrics lists them in.
    return [...byGroup].sort(([a], [b]) => String(a).localeCompare(String(b)))
      .map(([group, points]) => ({ name: group, points }));
  }

  const API_PATH = (l) => (l.path && l.path.startsWith('/v1/') ? l.path : null);

  /** Request latency quantile `q` of the API's requests between consecutive samples. */
  function latency(q) {
    const points = [];
    for (let i = 1; i < samples.length; i++) {
      const buckets = new Map();
      for (const [at, sign] of [[samples[i], 1], [samples[i - 1], -1]]) {
        for (const s of at.series) {
          if (s.name !== 'mmgate_request_duration_seconds_bucket' || !API_PATH(s.labels)) continue;
          buckets.set(s.labels.le, (buckets.get(s.labels.le) || 0) + sign * s.value);
        }
      }
      const sorted = [...buckets].map(([le, n]) => [le === '+Inf' ? Infinity : Number(le), n]).sort((a, b) => a[0] - b[0]);
      const total = sorted.length ? sorted[sorted.length - 1][1] : 0;
      if (total <= 0) continue;
      const bound = sorted.find(([, n]) => n >= q * total);
      if (bound && Number.isFinite(bound[0])) points.push([samples[i].t, bound[0]]);
    }
    return { name: `p${Math.round(q * 100)}`, points };
  }

  function drawCharts() {
    const charts = [
      { title: 'Requests per second, by status', series: lines('mmgate_requests_total', (l) => l.status, true), unit: '/s' },
      { title: 'API latency (histogram bucket bounds)', series: [latency(0.5), latency(0.95)], unit: ' s' },
      { title: 'Media tokens per second, by modality', series: lines('mmgate_media_tokens_total', (l) => l.modality, true), unit: '/s' },
      {
        title: 'Queues: plugins, encoders, engine',
        series: [
          ...lines('mmgate_plugin_queue', () => 'plugin queue', false),
          ...lines('mmgate_plugin_running', () => 'plugins running', false),
          ...lines('mmgate_encoder_queue', () => 'encoder queue', false),
          ...lines('mmgate_engine_queued', () => 'engine queued', false),
          ...lines('mmgate_engine_waiting_for_encoder', () => 'waiting for encoder', false),
          ...lines('mmgate_engine_running', () => 'engine running', false),
        ],
        unit: '',
      },
      { title: 'Upstream servers in rotation', series: lines('mmgate_upstream_healthy', (l) => `${l.model} ${l.upstream}`, false), unit: '', empty: 'No upstream servers.' },
    ];
    $('#charts').replaceChildren(...charts.map(chart));
  }

  function chart({ title, series, unit, empty }) {
    const box = el('figure', { class: 'chart', 'data-chart': title }, el('h3', {}, title));
    const now = Date.now() / 1000;
    const top = Math.max(0, ...series.flatMap((s) => s.points.map(([, v]) => v)));
    const max = top > 0 ? top : 1;
    const W = 400;
    const H = 140;
    const ns = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
    svg.setAttribute('role', 'img');
    svg.setAttribute('aria-label', `${title}, over the last minutes`);
    const add = (tag, attrs, text) => {
      const node = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
    };
    add('line', { x1: 0, y1: H - 16, x2: W, y2: H - 16, stroke: '#d8dce3' });
    add('text', { x: 2, y: 10, 'font-size': 10, fill: '#5b6474' }, `${formatValue(top)}${unit}`);
    // The time since the first sample, up to the whole window: a new page's few points are not
    // squeezed against the right edge.
    const span = Math.max(20, Math.min(WINDOW_SECONDS, now - (samples.length ? samples[0].t : now)));
    add('text', { x: 2, y: H - 3, 'font-size': 10, fill: '#5b6474' },
      span >= 120 ? `−${Math.round(span / 60)} min` : `−${Math.round(span)} s`);
    add('text', { x: W - 2, y: H - 3, 'font-size': 10, fill: '#5b6474', 'text-anchor': 'end' }, 'now');
    series.forEach((s, i) => {
      if (!s.points.length) return;
      const xy = s.points.map(([t, v]) => [W * (1 - (now - t) / span), H - 16 - ((H - 28) * v) / max]);
      const color = COLORS[i % COLORS.length];
      if (xy.length === 1) add('circle', { cx: xy[0][0], cy: xy[0][1], r: 2.5, fill: color });
      else add('polyline', { points: xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(' '), fill: 'none', stroke: color, 'stroke-width': 2 });
    });
    box.append(svg);
    const legend = el('figcaption', { class: 'legend' });
    if (!series.length) legend.append(empty || 'Nothing yet.');
    series.forEach((s, i) => {
      const last = s.points.length ? s.points[s.points.length - 1][1] : null;
      const item = el('span', {}, `${s.name}: `, el('b', { class: 'now' }, last === null ? '—' : `${formatValue(last)}${unit}`));
      item.style.setProperty('--swatch', COLORS[i % COLORS.length]);
      legend.append(item);
    });
    box.append(legend);
    return box;
  }

  function formatValue(v) {
    if (v === 0) return '0';
    if (v >= 100) return v.toFixed(0);
    if (v >= 1) return v.toFixed(1);
    return v.toPrecision(2);
  }

  // ---- Start ----
  const first = tabs.find((t) => pageOf(t) === location.hash.slice(1)) || tabs[0];
  select(first, false);
})();
