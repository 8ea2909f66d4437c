package main

// Counting tokens in an engine's server-sent events, by the rule of the
// sidecar's sse.py: with usage in the stream its completion_tokens is exact;
// without it every event with a choice is one token (vLLM sends one per token,
// also when it holds the token's text back), except chat's role chunk and a
// finishing event that carries nothing (an empty delta, or empty text without
// stop_reason: OpenAI's and llm-d-inference-sim's last event). Events with
// text are "content"; TBT is timed between them. Only an event with
// "usage":{ is parsed as JSON. tests/fixtures/sse drives both counters.

import (
	"bytes"
	"encoding/json"
)

var (
	sseSep       = []byte("\n\n")
	sseData      = []byte("data: ")
	sseDone      = []byte("[DONE]")
	sseUsage     = []byte(`"usage":{`)
	choices      = [][2][]byte{{[]byte(`"choices":[`), []byte(`"choices":[]`)}, {[]byte(`"choices": [`), []byte(`"choices": []`)}}
	deltaKey     = []byte(`"delta":`)
	roleKey      = []byte(`"role":`)
	emptyDelta   = [][]byte{[]byte(`"delta":{}`), []byte(`"delta": {}`)}
	emptyText    = [][]byte{[]byte(`"text":""`), []byte(`"text": ""`)}
	emptyContent = [][]byte{[]byte(`"content":""`), []byte(`"content": ""`)}
	stopReason   = []byte(`"stop_reason"`)
)

type scanner struct {
	tail     []byte
	counted  int // token events seen
	contents int // events with text seen (TBT is timed between them)
	exact    int // completion_tokens from usage; -1 until seen
}

func newScanner() *scanner { return &scanner{exact: -1} }

// tokens is what the stream has produced so far: the usage count when seen.
func (s *scanner) tokens() int {
	if s.exact >= 0 {
		return s.exact
	}
	return s.counted
}

// feed takes the next bytes of the stream and returns how many token events
// and how many content events they completed.
func (s *scanner) feed(data []byte) (int, int) {
	buf := data
	if len(s.tail) > 0 {
		buf = append(s.tail, data...)
	}
	found, content := 0, 0
	for {
		i := bytes.Index(buf, sseSep)
		if i < 0 {
			break
		}
		if i > 0 {
			tok, text := s.classify(buf[:i])
			if tok {
				found++
			}
			if text {
				content++
			}
		}
		buf = buf[i+len(sseSep):]
	}
	s.tail = append(s.tail[:0], buf...)
	s.counted += found
	s.contents += content
	return found, content
}

func containsAny(payload []byte, needles [][]byte) bool {
	for _, n := range needles {
		if bytes.Contains(payload, n) {
			return true
		}
	}
	return false
}

// classify reads one event; it reports whether the event counts as a token and
// whether it carries text.
func (s *scanner) classify(raw []byte) (bool, bool) {
	payload := bytes.TrimPrefix(raw, sseData)
	payload = bytes.TrimSpace(payload)
	if bytes.Equal(payload, sseDone) {
		return false, false
	}
	if bytes.Contains(payload, sseUsage) {
		var doc struct {
			Usage *struct {
				CompletionTokens *int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if json.Unmarshal(payload, &doc) == nil && doc.Usage != nil && doc.Usage.CompletionTokens != nil {
			s.exact = *doc.Usage.CompletionTokens
		}
	}
	hasChoice := false
	for _, c := range choices {
		if bytes.Contains(payload, c[0]) && !bytes.Contains(payload, c[1]) {
			hasChoice = true
		}
	}
	if !hasChoice {
		return false, false
	}
	if bytes.Contains(payload, deltaKey) { // chat
		if bytes.Contains(payload, roleKey) || containsAny(payload, emptyDelta) {
			return false, false
		}
		return true, !containsAny(payload, emptyContent)
	}
	if containsAny(payload, emptyText) {
		return bytes.Contains(payload, stopReason), false
	}
	return true, true
}

// usageTokens is completion_tokens of a whole (non-streamed) answer, 0 without usage.
func usageTokens(body []byte) int {
	var doc struct {
		Usage *struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &doc) != nil || doc.Usage == nil {
		return 0
	}
	return doc.Usage.CompletionTokens
}
