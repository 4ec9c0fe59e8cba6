/* Command line parsing, in Linux's syntax: virtio_mmio.device=<size>@<base>:<irq>[:<id>]. */
#include "cmdline.h"

struct cur {
	const char *p, *end;
};

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int at_end(struct cur *c) { return c->p >= c->end || is_space(*c->p); }

/* Decimal or 0x hex, with an optional K/M/G suffix (like the kernel's memparse). */
static int parse_num(struct cur *c, u64 *out, int suffixes)
{
	u64 v = 0;
	u32 base = 10, digits = 0;
	if (c->end - c->p >= 2 && c->p[0] == '0' && (c->p[1] == 'x' || c->p[1] == 'X')) {
		base = 16;
		c->p += 2;
	}
	for (; c->p < c->end; c->p++, digits++) {
		char ch = *c->p;
		u32 d;
		if (ch >= '0' && ch <= '9')
			d = (u32)(ch - '0');
		else if (base == 16 && ch >= 'a' && ch <= 'f')
			d = (u32)(ch - 'a' + 10);
		else if (base == 16 && ch >= 'A' && ch <= 'F')
			d = (u32)(ch - 'A' + 10);
		else
			break;
		if (v >> 59) /* no sane value is this large; stops the product overflowing */
			return -1;
		v = v * base + d;
	}
	if (!digits)
		return -1;
	if (suffixes && c->p < c->end) {
		u32 shift = 0;
		switch (*c->p) {
		case 'k':
		case 'K':
			shift = 10;
			break;
		case 'm':
		case 'M':
			shift = 20;
			break;
		case 'g':
		case 'G':
			shift = 30;
			break;
		}
		if (shift) {
			if (v >> (64 - shift))
				return -1;
			v <<= shift;
			c->p++;
		}
	}
	*out = v;
	return 0;
}

static int expect(struct cur *c, char ch)
{
	if (c->p < c->end && *c->p == ch) {
		c->p++;
		return 0;
	}
	return -1;
}

static int starts(struct cur *c, const char *prefix)
{
	const char *p = c->p;
	for (; *prefix; prefix++, p++)
		if (p >= c->end || *p != *prefix)
			return 0;
	c->p = p;
	return 1;
}

static int parse_mmio(struct cur *c, struct tg_mmio_dev *d)
{
	u64 irq, id;
	if (parse_num(c, &d->size, 1) || expect(c, '@') || parse_num(c, &d->base, 1) ||
	    expect(c, ':') || parse_num(c, &irq, 0) || irq > 0xffffffffu)
		return -1;
	if (!expect(c, ':') && parse_num(c, &id, 0))
		return -1;
	d->irq = (u32)irq;
	return at_end(c) ? 0 : -1;
}

void tg_cmdline_parse(const char *s, u32 max, struct tg_cmdline *out)
{
	u32 n = 0;
	while (n < max && s[n])
		n++;
	struct cur c = {s, s + n};
	memset(out, 0, sizeof *out);
	while (c.p < c.end) {
		if (is_space(*c.p)) {
			c.p++;
			continue;
		}
		if (starts(&c, "virtio_mmio.device=")) {
			struct tg_mmio_dev d;
			if (parse_mmio(&c, &d))
				out->bad++;
			else if (out->ndev < TG_MAX_MMIO)
				out->dev[out->ndev++] = d;
		} else if (starts(&c, "testguest.irqtest") && at_end(&c)) {
			out->irqtest = 1;
		} else if (starts(&c, "testguest.echo") && at_end(&c)) {
			out->echo = 1;
		} else if (starts(&c, "testguest.disk=")) {
			u64 n;
			if (parse_num(&c, &n, 0) || !at_end(&c) || !n || n > 0xffffffffu)
				out->bad++;
			else
				out->disk = (u32)n;
		} else if (starts(&c, "testguest.connect=")) {
			u64 port;
			if (parse_num(&c, &port, 0) || !at_end(&c) || !port || port > 0xffffffffu)
				out->bad++;
			else
				out->connect_port = (u32)port;
		}
		while (c.p < c.end && !is_space(*c.p))
			c.p++;
	}
}
