package main

// Counting tokens in vLLM's server-sent events, by the rule of the sidecar's
// sse.py: with usage in the stream its completion_tokens is exact; without it
// every event carrying non-empty text (completions) or content (chat) is one
// token. Only an event with "usage":{ is parsed as JSON.

import (
	"bytes"
	"encoding/json"
)

var (
	sseSep       = []byte("\n\n")
	sseData      = []byte("data: ")
	sseDone      = []byte("[DONE]")
	sseUsage     = []byte(`"usage":{`)
	emptyChoices = []byte(`"choices":[]`)
	emptyText    = []byte(`"text":""`)
	emptyContent = []byte(`"content":""`)
	noContent    = []byte(`"content":null`)
	textMember   = []byte(`"text":`)
)

type scanner struct {
	tail    []byte
	counted int // token events seen
	exact   int // completion_tokens from usage; -1 until seen
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
// they completed.
func (s *scanner) feed(data []byte) int {
	buf := data
	if len(s.tail) > 0 {
		buf = append(s.tail, data...)
	}
	found := 0
	for {
		i := bytes.Index(buf, sseSep)
		if i < 0 {
			break
		}
		if i > 0 && s.classify(buf[:i]) {
			found++
		}
		buf = buf[i+len(sseSep):]
	}
	s.tail = append(s.tail[:0], buf...)
	s.counted += found
	return found
}

// classify reads one event; it reports whether the event carries a token.
func (s *scanner) classify(raw []byte) bool {
	payload := bytes.TrimPrefix(raw, sseData)
	payload = bytes.TrimSpace(payload)
	if bytes.Equal(payload, sseDone) {
		return false
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
	return !(bytes.Contains(payload, emptyChoices) ||
		bytes.Contains(payload, emptyText) ||
		bytes.Contains(payload, emptyContent) ||
		(bytes.Contains(payload, noContent) && !bytes.Contains(payload, textMember)))
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
