// A Chat Completions agent in Node.js (18+, no packages: the built-in fetch), run once per episode as a command.
// The trainer sets OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL (this episode's endpoint, key and model name)
// and TRL_AGENTIC_TASK (the dataset row as JSON). The last JSON line printed is the episode's result.

const baseUrl = process.env.OPENAI_BASE_URL;
const apiKey = process.env.OPENAI_API_KEY;
const model = process.env.OPENAI_MODEL || "policy";
const task = JSON.parse(process.env.TRL_AGENTIC_TASK);

const tools = [
  {
    type: "function",
    function: {
      name: "calculator",
      description: "Evaluate an arithmetic expression with numbers, + - * / % and parentheses.",
      parameters: {
        type: "object",
        properties: { expression: { type: "string", description: "e.g. '12 * (3 + 4)'" } },
        required: ["expression"],
      },
    },
  },
];

// The tool: arithmetic only (digits, operators, parentheses), so nothing the model writes runs as code.
function calculator({ expression }) {
  if (typeof expression !== "string" || !/^[\d\s+\-*/%().]+$/.test(expression) || /\/[/*]/.test(expression)) {
    throw new Error("only numbers, + - * / % and parentheses are allowed");
  }
  const value = Function(`"use strict"; return (${expression});`)();
  if (!Number.isFinite(value)) throw new Error("the result is not a finite number");
  return String(value);
}

async function chat(messages) {
  const response = await fetch(`${baseUrl}/chat/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({ model, messages, tools }),
  });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  return (await response.json()).choices[0].message;
}

const messages = [...task.prompt];
let answer = "";
for (let round = 0; round < 6; round++) {
  const message = await chat(messages);
  messages.push(message); // sent back as returned: the next call continues it
  answer = message.content ?? "";
  if (!message.tool_calls?.length) break;
  for (const call of message.tool_calls) {
    let content;
    try {
      content = calculator(JSON.parse(call.function.arguments));
    } catch (error) {
      content = `Error: ${error.message}`; // the model reads the error and may try again
    }
    messages.push({ role: "tool", tool_call_id: call.id, content });
  }
}
console.log(JSON.stringify({ answer }));
