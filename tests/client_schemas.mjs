// Writes tests/client_schemas.json: tool and answer schemas as zod 4 (z.toJSONSchema), zod 3 (zod-to-json-schema)
// and TypeBox emit them. Regenerate: npm install zod@4 zod3@npm:zod@3 zod-to-json-schema @sinclair/typebox, then
// node client_schemas.mjs > client_schemas.json
import { readFileSync } from "node:fs";
import { z } from "zod";
import { z as z3 } from "zod3";
import { zodToJsonSchema } from "zod-to-json-schema";
import { Type } from "@sinclair/typebox";

const version = (name) => JSON.parse(readFileSync(`node_modules/${name}/package.json`, "utf8")).version;

// a shell tool as coding agents define it, with an environment map (z.record writes propertyNames)
const bash = z.strictObject({
  command: z.string().describe("The command to run"),
  timeout: z.number().max(600000).optional().describe("Timeout in milliseconds"),
  env: z.record(z.string(), z.string()).optional().describe("Extra environment variables"),
});
// a todo list: enums, bounded arrays, a record of integers
const todos = z.object({
  todos: z.array(z.object({
    content: z.string().min(1).max(40),
    status: z.enum(["pending", "in_progress", "completed"]),
  })).min(1).max(2),
  estimates: z.record(z.string(), z.number().int().min(0).max(9)),
});
// environment names that must be upper case: this propertyNames constrains
const envNames = z.object({ env: z.record(z.string().regex(/^[A-Z_]+$/), z.string()) });
// a file edit, zod 3 with zod-to-json-schema (draft-07 header, record as additionalProperties)
const edit = z3.object({
  file_path: z3.string().describe("The absolute path of the file"),
  old_string: z3.string().max(40),
  new_string: z3.string().max(40),
  replace_all: z3.boolean().default(false).optional(),
}).strict();
// TypeBox: $id, a record as patternProperties, an intersection closed by unevaluatedProperties
const drawing = Type.Object({
  name: Type.String({ minLength: 1, maxLength: 20 }),
  scores: Type.Record(Type.String(), Type.Integer({ minimum: 0, maximum: 9 })),
  where: Type.Intersect([Type.Object({ x: Type.Integer() }), Type.Object({ y: Type.Integer() })],
                        { unevaluatedProperties: false }),
  box: Type.Object({ w: Type.Integer(), h: Type.Integer() }, { unevaluatedProperties: false }),
}, { $id: "Drawing", additionalProperties: false });

console.log(JSON.stringify({
  generated_by: `client_schemas.mjs: zod ${version("zod")}, zod ${version("zod3")} with zod-to-json-schema ` +
    `${version("zod-to-json-schema")}, @sinclair/typebox ${version("@sinclair/typebox")}`,
  zod4_bash_draft7: z.toJSONSchema(bash, { target: "draft-7" }),
  zod4_todos: z.toJSONSchema(todos),
  zod4_env_names: z.toJSONSchema(envNames),
  zod3_edit: zodToJsonSchema(edit),
  typebox_drawing: drawing,
}, null, 1));
