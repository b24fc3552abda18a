//! The Responses store: the last responses kept (`--responses-store N`, and at most
//! [`STORE_BYTES`] of them), each with the conversation that led to it, for
//! `GET /v1/responses/{id}` and `previous_response_id`. The oldest go first; an evicted or
//! deleted id is a 404.

use std::collections::VecDeque;
use std::sync::Mutex;

use kiln_api::Message;
use serde_json::Value;

/// The most bytes (JSON of the responses plus the text of their conversations) kept.
pub(crate) const STORE_BYTES: usize = 64 << 20;

#[derive(Debug, Clone)]
struct Stored {
    id: String,
    response: Value,
    /// The conversation up to and including this response's output.
    history: Vec<Message>,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: VecDeque<Stored>,
    bytes: usize,
}

/// Bounded in count and in bytes; shared by every call of the HTTP door.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    capacity: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

fn size(response: &Value, history: &[Message]) -> usize {
    let text: usize = history
        .iter()
        .map(|m| {
            m.content.len()
                + m.reasoning.as_ref().map_or(0, String::len)
                + m.tool_calls
                    .iter()
                    .map(|c| c.arguments.len() + c.name.len() + c.id.len())
                    .sum::<usize>()
        })
        .sum();
    response.to_string().len() + text
}

impl ResponseStore {
    pub(crate) fn new(capacity: usize, max_bytes: usize) -> Self {
        Self {
            capacity,
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding it left whole entries behind: keep serving them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `response` (whose `id` it is filed under) and its conversation, evicting the
    /// oldest over the bounds; one larger than the whole store is not kept.
    pub(crate) fn put(&self, id: &str, response: Value, history: Vec<Message>) {
        if self.capacity == 0 {
            return;
        }
        let bytes = size(&response, &history);
        if bytes > self.max_bytes {
            tracing::warn!(id, bytes, "a response too large for the store is not kept");
            return;
        }
        let mut s = self.lock();
        while s.entries.len() >= self.capacity || s.bytes + bytes > self.max_bytes {
            match s.entries.pop_front() {
                Some(old) => s.bytes -= old.bytes,
                None => break,
            }
        }
        s.bytes += bytes;
        s.entries.push_back(Stored {
            id: id.to_owned(),
            response,
            history,
            bytes,
        });
    }

    pub(crate) fn response(&self, id: &str) -> Option<Value> {
        let s = self.lock();
        s.entries
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.response.clone())
    }

    pub(crate) fn history(&self, id: &str) -> Option<Vec<Message>> {
        let s = self.lock();
        s.entries
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.history.clone())
    }

    /// Whether it was there.
    pub(crate) fn delete(&self, id: &str) -> bool {
        let mut s = self.lock();
        let Some(i) = s.entries.iter().position(|e| e.id == id) else {
            return false;
        };
        if let Some(old) = s.entries.remove(i) {
            s.bytes -= old.bytes;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_api::Role;

    #[test]
    fn bounded_by_count_and_bytes() {
        let s = ResponseStore::new(2, 1000);
        let h = |t: &str| vec![Message::new(Role::User, t)];
        s.put("a", Value::from(1), h("x"));
        s.put("b", Value::from(2), h("y"));
        s.put("c", Value::from(3), h("z"));
        assert!(s.response("a").is_none(), "the oldest went first");
        assert_eq!(s.response("c"), Some(Value::from(3)));
        assert_eq!(
            s.history("b").map(|h| h[0].content.clone()).as_deref(),
            Some("y")
        );
        assert!(s.delete("b") && !s.delete("b"));
        assert!(s.history("b").is_none());
        s.put("big", Value::from(4), h(&"w".repeat(999)));
        assert!(s.response("c").is_none(), "evicted to make room in bytes");
        assert!(s.response("big").is_some());
        s.put("huge", Value::from(5), h(&"w".repeat(2000)));
        assert!(s.response("huge").is_none() && s.response("big").is_some());
        let off = ResponseStore::new(0, 1000);
        off.put("a", Value::from(1), h("x"));
        assert!(off.response("a").is_none());
    }
}
