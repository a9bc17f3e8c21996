//! The layouts chat logs come in, normalised to one: `{"messages": [OpenAI chat messages], ...}`
//! (docs/formats/openai-chat.md has each writer's mapping).
//!
//! - `messages`: a conversation object, as fine-tuning sets, the openai SDK's `model_dump()`
//!   (nulls kept or left out) and many agent SDKs write it; `tools` and `parallel_tool_calls`
//!   are kept;
//! - `proxy`: one model call as gateways and proxies log it, `{"request": {"messages", "tools",
//!   ...}, "response": <ChatCompletion>}`: the request's messages and the response's first
//!   choice's message (a failed call, without choices, gives the request's messages);
//! - `langchain`: LangChain's `messages_to_dict` dump, a list of `{"type", "data"}` message
//!   dicts (human, ai, system, tool, function, chat), as a line of its own or as `messages`;
//!   an AI message's `tool_calls` (`{"name", "args", "id"}`), else its
//!   `additional_kwargs.tool_calls` / `function_call`, become OpenAI tool calls;
//! - legacy function calling, in every layout: an assistant message's `function_call` becomes
//!   a tool call without an id, answered by the next `function` message of its name.

use serde_json::{json, Map, Value};

use crate::jsonl::type_name;

/// Which layout a line was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    Messages,
    Proxy,
    Langchain,
}

impl Layout {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Layout::Messages => "messages",
            Layout::Proxy => "proxy",
            Layout::Langchain => "langchain",
        }
    }
}

/// True when `value` reads as one of the layouts (the first line of a `.jsonl` file).
pub(crate) fn recognised(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.first().is_some_and(is_langchain_message),
        Value::Object(object) => {
            (object.get("messages").is_some_and(Value::is_array)
                && !object.contains_key("task")
                && !object.contains_key("steps"))
                || object
                    .get("request")
                    .and_then(|r| r.get("messages"))
                    .is_some_and(Value::is_array)
        }
        _ => false,
    }
}

fn is_langchain_message(value: &Value) -> bool {
    value.get("type").is_some_and(Value::is_string)
        && value.get("data").is_some_and(Value::is_object)
        && value.get("role").is_none()
}

/// The line as a conversation object with OpenAI messages, and its layout; an error names the
/// field.
pub(crate) fn normalise(value: Value) -> Result<(Value, Layout), (String, String)> {
    let (mut conversation, layout) = match value {
        Value::Array(items) => (json!({ "messages": items }), Layout::Langchain),
        Value::Object(object) if object.contains_key("request") => (proxy(object)?, Layout::Proxy),
        Value::Object(object) => (Value::Object(object), Layout::Messages),
        other => {
            return Err((
                String::new(),
                format!(
                    "a chat log line must be a JSON object or a list of LangChain messages, got {}",
                    type_name(&other)
                ),
            ))
        }
    };
    let mut langchain = layout == Layout::Langchain;
    if let Some(Value::Array(messages)) = conversation.get_mut("messages") {
        langchain |= messages.first().is_some_and(is_langchain_message);
        for (i, message) in messages.iter_mut().enumerate() {
            if is_langchain_message(message) {
                *message = from_langchain(message, i)?;
            }
            legacy_function_call(message);
        }
    }
    let layout = if langchain { Layout::Langchain } else { layout };
    Ok((conversation, layout))
}

/// A proxy log line: the request's messages, then the response's message.
fn proxy(mut object: Map<String, Value>) -> Result<Value, (String, String)> {
    let request = match object.remove("request") {
        Some(Value::Object(request)) => request,
        Some(other) => {
            return Err((
                "request".into(),
                format!("must be an object, got {}", type_name(&other)),
            ))
        }
        None => unreachable!("called for objects with a request"),
    };
    let mut messages = match request.get("messages") {
        Some(Value::Array(messages)) => messages.clone(),
        _ => {
            return Err((
                "request.messages".into(),
                "a proxy log line needs the request's `messages` list".into(),
            ))
        }
    };
    let response = object.remove("response").unwrap_or(Value::Null);
    if let Some(message) = response
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("message"))
        .filter(|m| m.is_object())
    {
        messages.push(message.clone());
    }
    object.insert("messages".into(), Value::Array(messages));
    for key in ["tools", "functions", "parallel_tool_calls", "metadata"] {
        if let Some(value) = request.get(key) {
            object.entry(key).or_insert_with(|| value.clone());
        }
    }
    if let Some(id) = response.get("id").filter(|id| id.is_string()) {
        object.entry("response_id").or_insert_with(|| id.clone());
    }
    Ok(Value::Object(object))
}

/// One LangChain message dict as an OpenAI message.
fn from_langchain(message: &Value, index: usize) -> Result<Value, (String, String)> {
    let kind = message["type"].as_str().unwrap_or_default();
    let data = &message["data"];
    let role = match kind {
        "human" => "user",
        "ai" => "assistant",
        "system" => "system",
        "tool" => "tool",
        "function" => "function",
        "chat" => data.get("role").and_then(Value::as_str).unwrap_or("user"),
        other => {
            return Err((
                format!("messages[{index}].type"),
                format!(
                    "unknown LangChain message type `{other}` (expected human, ai, system, tool, function or chat)"
                ),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::from(role));
    out.insert(
        "content".into(),
        data.get("content").cloned().unwrap_or(Value::Null),
    );
    for key in ["name", "tool_call_id"] {
        if let Some(value) = data.get(key).filter(|v| v.is_string()) {
            out.insert(key.into(), value.clone());
        }
    }
    let calls: Vec<Value> = data
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|call| {
            let arguments = match call.get("args") {
                Some(Value::String(text)) => text.clone(),
                Some(args) => args.to_string(),
                None => "{}".into(),
            };
            json!({
                "id": call.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": call.get("name").cloned().unwrap_or(Value::Null), "arguments": arguments},
            })
        })
        .collect();
    let extra = data.get("additional_kwargs");
    if !calls.is_empty() {
        out.insert("tool_calls".into(), Value::Array(calls));
    } else if let Some(raw) = extra
        .and_then(|k| k.get("tool_calls"))
        .filter(|c| c.is_array())
    {
        out.insert("tool_calls".into(), raw.clone());
    }
    if let Some(call) = extra
        .and_then(|k| k.get("function_call"))
        .filter(|c| c.is_object())
    {
        out.insert("function_call".into(), call.clone());
    }
    Ok(Value::Object(out))
}

/// An assistant message's legacy `function_call` as a tool call (when it has no `tool_calls`).
fn legacy_function_call(message: &mut Value) {
    let Some(object) = message.as_object_mut() else {
        return;
    };
    let has_calls = object
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    let Some(call) = object
        .get("function_call")
        .filter(|c| c.is_object())
        .cloned()
    else {
        return;
    };
    if !has_calls {
        object.insert(
            "tool_calls".into(),
            json!([{ "id": null, "type": "function", "function": call }]),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_layout_becomes_openai_messages() {
        let (proxy, layout) = normalise(json!({
            "request": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "response": {"id": "r1", "choices": [{"message": {"role": "assistant", "content": "hello"}}]}
        }))
        .unwrap();
        assert_eq!(layout, Layout::Proxy);
        assert_eq!(proxy["messages"].as_array().unwrap().len(), 2);
        assert_eq!(proxy["tools"][0]["type"], "function");
        assert_eq!(proxy["response_id"], "r1");
        let (lc, layout) = normalise(json!([
            {"type": "human", "data": {"content": "refund 7"}},
            {"type": "ai", "data": {"content": "", "tool_calls": [{"name": "refund", "args": {"id": 7}, "id": "c1"}]}},
            {"type": "tool", "data": {"content": "ok", "tool_call_id": "c1"}}
        ]))
        .unwrap();
        assert_eq!(layout, Layout::Langchain);
        assert_eq!(lc["messages"][0]["role"], "user");
        assert_eq!(
            lc["messages"][1]["tool_calls"][0]["function"]["name"],
            "refund"
        );
        assert_eq!(
            lc["messages"][1]["tool_calls"][0]["function"]["arguments"],
            "{\"id\":7}"
        );
        assert_eq!(lc["messages"][2]["tool_call_id"], "c1");
        let (legacy, _) = normalise(json!({"messages": [
            {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}, "tool_calls": null}
        ]}))
        .unwrap();
        assert_eq!(
            legacy["messages"][0]["tool_calls"][0]["function"]["name"],
            "f"
        );
        let bad = normalise(json!([{"type": "robot", "data": {}}])).unwrap_err();
        assert_eq!(bad.0, "messages[0].type");
    }
}
