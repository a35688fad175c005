// dalle-serve's web page, its script run by node against a live server with a stand-in DOM:
// a submitted job is kept in the browser's storage, and a reload of the page (its script run
// again with the same storage and a fresh DOM) finds the job, shows its prompt in the form and
// its images captioned with the prompt, seed and candidate.
// Usage: node web_page_test.js BASE_URL API_KEY   (serve_test.py runs it; exit 1 on a failure)
const [base, key] = process.argv.slice(2);

function fail(message) {
  console.error("web_page_test: FAILED: " + message);
  process.exit(1);
}

const storage = {};
const localStorage = {
  getItem: (name) => storage[name] ?? null,
  setItem: (name, value) => { storage[name] = String(value); },
  removeItem: (name) => { delete storage[name]; },
};
const sessionStorage = { getItem: () => null, setItem() {}, removeItem() {} };
const fields = { prompt: "a red sandal on the right", n: "1", candidates: "2", seed: "3", guidance: "", key };

// Runs the page's script once, as a (re)loaded page does; its elements by id.
function load(script) {
  const elements = {};
  const element = (id) => elements[id] || (elements[id] = {
    id, value: fields[id] ?? "", checked: false, hidden: true, disabled: false, className: "", textContent: "",
    listeners: {}, children: null,
    addEventListener(type, listener) { this.listeners[type] = listener; },
    replaceChildren(...children) { this.children = children; },
    append() {},
  });
  const document = { getElementById: element,
                     createElement: () => ({ children: [], append(...children) { this.children.push(...children); } }) };
  new Function("document", "localStorage", "sessionStorage", "fetch", "performance", script)(
    document, localStorage, sessionStorage, (path, options) => fetch(base + path, options), performance);
  return element;
}

const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

(async () => {
  const page = await (await fetch(base + "/")).text();
  const script = page.slice(page.indexOf("<script>") + 8, page.indexOf("</script>"));
  const first = load(script);
  first("form").listeners.submit({ preventDefault() {} });
  for (let tries = 0; tries < 100 && !storage["dalle-serve-job"]; ++tries) await sleep(20);
  if (!storage["dalle-serve-job"]) fail("the submitted job was not kept: " + first("status").textContent);
  const { id } = JSON.parse(storage["dalle-serve-job"]);
  if (!/^[0-9a-f]{32}$/.test(id)) fail("a job id of " + id);
  fields.prompt = "a white coat on the left";  // the form's default, as a reload shows it
  const reloaded = load(script);  // the page reloaded while the job runs
  if (reloaded("prompt").value !== "a red sandal on the right") {
    fail("the reloaded page's prompt is " + reloaded("prompt").value + ", not the job's");
  }
  // Until the reloaded page is done following (partial images may show before the images).
  for (let tries = 0; tries < 1200 && (reloaded("go").disabled || !reloaded("images").children); ++tries) {
    await sleep(100);
  }
  const images = reloaded("images").children;
  if (!images || images.length !== 1) fail("the reloaded page shows " + (images ? images.length : "no") +
                                           " images; status: " + reloaded("status").textContent);
  if (reloaded("status").className === "error") fail("the reloaded page says " + reloaded("status").textContent);
  const caption = images[0].children[1].textContent;
  if (!/^a red sandal on the right \(seed 3, candidate [01]\)$/.test(caption)) fail("an image captioned " + caption);
  if (storage["dalle-serve-job"]) fail("the finished job is still kept");
  const job = await (await fetch(base + "/v1/images/jobs/" + id, { headers: { Authorization: "Bearer " + key } })).json();
  if (job.status !== "succeeded") fail("the job the page followed: " + JSON.stringify(job).slice(0, 200));
  console.log("web_page_test: passed");
  process.exit(0);  // the first page's follower may still be polling
})().catch((error) => fail(error.stack));
